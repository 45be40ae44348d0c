# K2CCuda.cmake — CUDA is optional. When nvcc is found:
#   - CMAKE_CUDA_ARCHITECTURES gets a default only if the user (or CUDAARCHS) gave none: the
#     compute capability of the GPU on this machine when nvidia-smi sees one, else 90 (the H200
#     the reference timings come from). Never "all": it multiplies build time for nothing.
#   - one shared CUDA runtime for every target, because student libraries are shared libraries
#     and must use the same runtime instance as the test program that calls them.
#   - -DK2C_CUDA=OFF builds the CPU parts only even where nvcc is present (a quick CPU build).
# Sets K2C_HAS_CUDA.
option(K2C_CUDA "Build the GPU parts when a CUDA compiler is found" ON)
set(K2C_HAS_CUDA OFF)
if(K2C_CUDA)
  include(CheckLanguage)
  check_language(CUDA)
endif()
if(K2C_CUDA AND CMAKE_CUDA_COMPILER)
  if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES AND NOT DEFINED ENV{CUDAARCHS})
    set(k2c_arch 90)
    find_program(K2C_NVIDIA_SMI nvidia-smi)
    if(K2C_NVIDIA_SMI)
      execute_process(COMMAND ${K2C_NVIDIA_SMI} --query-gpu=compute_cap --format=csv,noheader
                      OUTPUT_VARIABLE k2c_caps RESULT_VARIABLE k2c_rc ERROR_QUIET
                      OUTPUT_STRIP_TRAILING_WHITESPACE)
      if(k2c_rc EQUAL 0 AND k2c_caps MATCHES "^([0-9]+)\\.([0-9]+)")
        set(k2c_arch "${CMAKE_MATCH_1}${CMAKE_MATCH_2}")
      endif()
    endif()
    set(CMAKE_CUDA_ARCHITECTURES ${k2c_arch} CACHE STRING "CUDA architectures")
    message(STATUS "k2c: CMAKE_CUDA_ARCHITECTURES defaulted to ${k2c_arch}")
  endif()
  enable_language(CUDA)
  find_package(CUDAToolkit REQUIRED)
  # C++20 in device code too. CMake 3.25 predates nvcc 13 and does not list C++20 among its
  # features, so teach it the flag (newer CMake knows it already).
  if(NOT "cuda_std_20" IN_LIST CMAKE_CUDA_COMPILE_FEATURES)
    list(APPEND CMAKE_CUDA_COMPILE_FEATURES cuda_std_20)
    set(CMAKE_CUDA20_COMPILE_FEATURES cuda_std_20)
    set(CMAKE_CUDA20_STANDARD_COMPILE_OPTION "-std=c++20")
    set(CMAKE_CUDA20_EXTENSION_COMPILE_OPTION "-std=c++20")
  endif()
  set(CMAKE_CUDA_STANDARD 20)
  set(CMAKE_CUDA_STANDARD_REQUIRED ON)
  set(CMAKE_CUDA_RUNTIME_LIBRARY Shared)
  # Line tables cost nothing at run time and let compute-sanitizer and ncu point at source lines.
  add_compile_options($<$<COMPILE_LANGUAGE:CUDA>:-lineinfo>)
  set(K2C_HAS_CUDA ON)
elseif(NOT K2C_CUDA)
  message(STATUS "k2c: K2C_CUDA=OFF: building the CPU parts only")
else()
  message(STATUS "k2c: no CUDA compiler found: building the CPU parts only")
endif()
