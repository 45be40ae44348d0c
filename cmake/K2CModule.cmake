# K2CModule.cmake — k2c_add_module(NN_name KIND gpu|cpu|mpi [RANKS 1 2 ...] [SOURCES more.cu ...]
#                                  [MODEL] [USES NN_other ...]): one call declares a whole module.
#
# For module NN_name it builds
#   k2c_impl_NN_name   the implementation, from ${K2C_IMPL}/NN_name/name.cu, as a SHARED library
#                      linked with --no-undefined against the CUDA runtime only: a student file
#                      that calls cuBLAS (or anything else the module asks them to write) fails
#                      to link instead of passing on borrowed speed; SOURCES names further files
#                      of the same folder (a module in two parts; in a cpu or mpi module, .cu
#                      parts and their test_name_*.cu tests are built only where CUDA is);
#   k2c_test_NN_name   autograder/NN_name/test_name.cu (and test_name_*.cu, its further parts) +
#                      the shared test main, a GoogleTest program; CTest tests discovered at test
#                      time, labelled moduleNN and KIND;
#   k2c_bench_NN_name  autograder/NN_name/bench_name.cu, a Google Benchmark program (if present);
#   k2c_tune_NN_name   autograder/NN_name/tune_name.cu, a tuner (if present).
# MODEL: the implementation links the model library k2c_model (the modules of Part II, whose
# students write a parallel algorithm around the course's layers, loss, optimizer and data). Their
# test program also links the GPU backend k2c_model_cuda where it is built (K2C_MODEL_CUDA=1, for
# the performance tests on NCCL), and autograder/NN_name/name_bench.cpp, if present, becomes the
# program k2c_name (MPI and the model library, like the tests).
# USES: the implementation also links the implementations of the modules listed (declared
# earlier), from the same tree: the capstone composes the student's own parallel algorithms of
# 12–17, so a build from assignments/ runs the student's code and one from solutions/ the
# reference's. Only their contracts' namespaces are visible, as for any caller.
# Each module is its own set of targets, so the grader builds them one at a time and a compile
# error in one module never blocks another.
function(k2c_add_module id)
  cmake_parse_arguments(arg "MODEL" "KIND" "RANKS;SOURCES;USES" ${ARGN})
  if(NOT id MATCHES "^([0-9][0-9])_([a-z0-9_]+)$")
    message(FATAL_ERROR "k2c_add_module: '${id}' is not NN_snake_name")
  endif()
  set(num ${CMAKE_MATCH_1})
  set(name ${CMAKE_MATCH_2})
  if(NOT arg_KIND MATCHES "^(gpu|cpu|mpi)$")
    message(FATAL_ERROR "k2c_add_module(${id}): KIND must be gpu, cpu or mpi")
  endif()
  if(arg_KIND STREQUAL "gpu" AND NOT K2C_HAS_CUDA)
    message(STATUS "k2c: module ${id} needs CUDA: skipped")
    return()
  endif()
  if(arg_KIND STREQUAL "mpi" AND NOT (K2C_HAS_MPI AND K2C_MPIEXEC))
    message(STATUS "k2c: module ${id} needs MPI and mpirun: skipped")
    return()
  endif()

  set(root ${PROJECT_SOURCE_DIR})
  set_property(GLOBAL APPEND PROPERTY K2C_MODULES ${id})
  # Device code in .cu, plain C++ (the distributed modules' algorithms) in .cpp.
  set(impl_src ${K2C_IMPL_DIR}/${id}/${name}.cu)
  if(NOT EXISTS ${impl_src})
    set(impl_src ${K2C_IMPL_DIR}/${id}/${name}.cpp)
  endif()
  set(test_src ${root}/autograder/${id}/test_${name}.cu)
  if(NOT EXISTS ${test_src})
    set(test_src ${root}/autograder/${id}/test_${name}.cpp)
  endif()
  # A test program too long for one file continues in test_name_*.cu / .cpp (one part each).
  file(GLOB test_parts CONFIGURE_DEPENDS ${root}/autograder/${id}/test_${name}_*.cu ${root}/autograder/${id}/test_${name}_*.cpp)
  list(SORT test_parts)
  list(APPEND test_src ${test_parts})
  set(extra_src ${arg_SOURCES})
  list(TRANSFORM extra_src PREPEND ${K2C_IMPL_DIR}/${id}/)
  # A CPU or MPI module may have a GPU part (19's decode kernel): its .cu files, and the test
  # parts that exercise them, are built only where CUDA is; the rest of the module builds anyway.
  set(cuda_parts OFF)
  if(NOT arg_KIND STREQUAL "gpu")
    if(K2C_HAS_CUDA)
      if(extra_src MATCHES "\\.cu(;|$)")
        set(cuda_parts ON)
      endif()
    else()
      list(FILTER extra_src EXCLUDE REGEX "\\.cu$")
      list(FILTER test_src EXCLUDE REGEX "_[a-z0-9]+\\.cu$")
    endif()
  endif()
  add_library(k2c_impl_${id} SHARED ${impl_src} ${extra_src})
  # The only target that compiles a student's files. The grader, grading a submission, compiles
  # them as the account that runs its tests (K2C_COMPILE_AS: `k2c compile-as`, see
  # autograder/k2c/process.h), so that what they read at build time is read with its rights.
  if(K2C_COMPILE_AS)
    set_target_properties(k2c_impl_${id} PROPERTIES CXX_COMPILER_LAUNCHER "${K2C_COMPILE_AS}"
                                                    CUDA_COMPILER_LAUNCHER "${K2C_COMPILE_AS}")
  endif()
  target_include_directories(k2c_impl_${id} PUBLIC ${root}/assignments/${id})
  target_link_libraries(k2c_impl_${id} PUBLIC k2c_headers)
  # The course's NVTX ranges compile to nothing in student code (see k2c/device/nvtx.h), and so
  # does NVTX itself: CUB's and Thrust's device-wide headers bring in its injection loader, whose
  # dlopen and dlsym would have the grader refuse the library (docs/SECURITY.md, row 14).
  target_compile_definitions(k2c_impl_${id} PRIVATE K2C_NO_NVTX NVTX_DISABLE)
  if(arg_KIND STREQUAL "gpu" OR cuda_parts)
    target_link_libraries(k2c_impl_${id} PUBLIC CUDA::cudart)
  endif()
  if(arg_MODEL)
    target_link_libraries(k2c_impl_${id} PUBLIC k2c_model)
  endif()
  foreach(used IN LISTS arg_USES)
    if(NOT TARGET k2c_impl_${used})
      message(FATAL_ERROR "k2c_add_module(${id}): USES ${used}, which is not a module declared before it")
    endif()
    target_link_libraries(k2c_impl_${id} PUBLIC k2c_impl_${used})
  endforeach()
  # Export the contract's namespace and nothing else: a student library that defines, say,
  # cublasSgemm_v2 or cudaEventElapsedTime cannot interpose them on the harness that measures it.
  # Written only when its text changes (file(CONFIGURE)), so a new configure relinks nothing.
  set(exports ${CMAKE_BINARY_DIR}/exports/${id}.map)
  file(CONFIGURE OUTPUT ${exports} CONTENT "{ global: extern \"C++\" { k2c::${name}::*; }; local: *; };\n" @ONLY)
  target_link_options(k2c_impl_${id} PRIVATE "LINKER:--no-undefined" "LINKER:--version-script=${exports}")
  set_property(TARGET k2c_impl_${id} APPEND PROPERTY LINK_DEPENDS ${exports})

  # Which module the program tests (k2c::testing::kProgram), in a source of its own: main() is
  # the shared k2c_test_main (or k2c_dist_test_main), compiled once. Written only when it changes.
  set(identity ${CMAKE_BINARY_DIR}/test_programs/${id}.cpp)
  file(CONFIGURE OUTPUT ${identity} @ONLY CONTENT
"// Written by k2c_add_module (cmake/K2CModule.cmake): which module this test program tests.
#include \"k2c/testing/testing.h\"
extern const k2c::testing::ProgramIdentity k2c::testing::kProgram = {
    \"${id}\", \"${K2C_IMPL}\", \"${root}/autograder/rubric.json\"};
")
  add_executable(k2c_test_${id} ${test_src} ${identity})
  # K2C_CUDA_PARTS: whether a cpu or mpi module's .cu parts (and their tests) are in the build, so a
  # test program built without them can still list their tests, skipped with the reason.
  target_compile_definitions(k2c_test_${id} PRIVATE K2C_CUDA_PARTS=$<BOOL:${cuda_parts}>)
  if(arg_KIND STREQUAL "mpi")
    target_link_libraries(k2c_test_${id} PRIVATE k2c_dist_test_main)
  else()
    target_link_libraries(k2c_test_${id} PRIVATE k2c_test_main)
  endif()
  target_link_libraries(k2c_test_${id} PRIVATE k2c_impl_${id} k2c_testing)
  if(arg_MODEL AND TARGET k2c_model_cuda)
    target_link_libraries(k2c_test_${id} PRIVATE k2c_model_cuda)
    target_compile_definitions(k2c_test_${id} PRIVATE K2C_MODEL_CUDA=1)
  endif()
  if(arg_KIND STREQUAL "mpi")
    # One CTest test per rank count, each running the whole program under mpirun on the MPI
    # backend (CI has no GPU; the NCCL runs happen through the grader on GPU machines).
    target_link_libraries(k2c_test_${id} PRIVATE k2c_dist)
    foreach(n IN LISTS arg_RANKS)
      k2c_add_rank_test(${id}.np${n} ${n} $<TARGET_FILE:k2c_test_${id}>)
      set_tests_properties(${id}.np${n} PROPERTIES LABELS "module${num};mpi" TIMEOUT 600)
    endforeach()
  else()
    if(arg_KIND STREQUAL "gpu")
      k2c_discover_tests(k2c_test_${id} LABELS "module${num};${arg_KIND}" LOCK gpu)
    else()
      k2c_discover_tests(k2c_test_${id} LABELS "module${num};${arg_KIND}")
    endif()
  endif()

  # A tuner, for modules whose implementation offers configurations to choose from.
  if(EXISTS ${root}/autograder/${id}/tune_${name}.cu)
    add_executable(k2c_tune_${id} ${root}/autograder/${id}/tune_${name}.cu)
    target_link_libraries(k2c_tune_${id} PRIVATE k2c_impl_${id} k2c_cuda k2c_core)
  endif()

  if(arg_MODEL AND arg_KIND STREQUAL "mpi" AND EXISTS ${root}/autograder/${id}/${name}_bench.cpp)
    add_executable(k2c_${name} ${root}/autograder/${id}/${name}_bench.cpp)
    target_link_libraries(k2c_${name} PRIVATE k2c_impl_${id} k2c_dist)
    if(TARGET k2c_model_cuda)
      # k2c_cuda for the in-run ceiling (cuBLAS's bf16 rate) that GPU figures are ratios to.
      target_link_libraries(k2c_${name} PRIVATE k2c_model_cuda k2c_cuda)
      target_compile_definitions(k2c_${name} PRIVATE K2C_MODEL_CUDA=1)
    endif()
  endif()

  # A GPU module's sweep, or a CPU/MPI module's sweep of its CUDA parts (19's decode kernel).
  if(benchmark_FOUND AND (arg_KIND STREQUAL "gpu" OR cuda_parts) AND EXISTS ${root}/autograder/${id}/bench_${name}.cu)
    add_executable(k2c_bench_${id} ${root}/autograder/${id}/bench_${name}.cu)
    target_link_libraries(k2c_bench_${id} PRIVATE k2c_impl_${id} k2c_cuda benchmark::benchmark)
  endif()
endfunction()
