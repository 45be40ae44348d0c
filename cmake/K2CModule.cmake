# K2CModule.cmake — k2c_add_module(NN_name KIND gpu|cpu): one call declares a whole module.
#
# For module NN_name it builds
#   k2c_impl_NN_name   the implementation, from ${K2C_IMPL}/NN_name/name.cu, as a SHARED library
#                      linked with --no-undefined against the CUDA runtime only: a student file
#                      that calls cuBLAS (or anything else the module asks them to write) fails
#                      to link instead of passing on borrowed speed;
#   k2c_test_NN_name   autograder/NN_name/test_name.cu + the shared test main, a GoogleTest
#                      program; CTest tests discovered at test time, labelled moduleNN and KIND;
#   k2c_bench_NN_name  autograder/NN_name/bench_name.cu, a Google Benchmark program (if present);
#   k2c_tune_NN_name   autograder/NN_name/tune_name.cu, a tuner (if present).
# Each module is its own set of targets, so the grader builds them one at a time and a compile
# error in one module never blocks another.
function(k2c_add_module id)
  cmake_parse_arguments(arg "" "KIND" "" ${ARGN})
  if(NOT id MATCHES "^([0-9][0-9])_([a-z0-9_]+)$")
    message(FATAL_ERROR "k2c_add_module: '${id}' is not NN_snake_name")
  endif()
  set(num ${CMAKE_MATCH_1})
  set(name ${CMAKE_MATCH_2})
  if(NOT arg_KIND MATCHES "^(gpu|cpu)$")
    message(FATAL_ERROR "k2c_add_module(${id}): KIND must be gpu or cpu")
  endif()
  if(arg_KIND STREQUAL "gpu" AND NOT K2C_HAS_CUDA)
    message(STATUS "k2c: module ${id} needs CUDA: skipped")
    return()
  endif()

  set(root ${PROJECT_SOURCE_DIR})
  set_property(GLOBAL APPEND PROPERTY K2C_MODULES ${id})
  add_library(k2c_impl_${id} SHARED ${K2C_IMPL_DIR}/${id}/${name}.cu)
  target_include_directories(k2c_impl_${id} PUBLIC ${root}/assignments/${id})
  target_link_libraries(k2c_impl_${id} PUBLIC k2c_headers CUDA::cudart)
  target_link_options(k2c_impl_${id} PRIVATE "LINKER:--no-undefined")

  add_executable(k2c_test_${id} ${root}/autograder/${id}/test_${name}.cu
                                ${root}/common/src/test_main.cpp)
  target_compile_definitions(k2c_test_${id} PRIVATE
    K2C_MODULE_ID="${id}" K2C_IMPL_NAME="${K2C_IMPL}"
    K2C_RUBRIC_DEFAULT="${root}/autograder/rubric.json")
  target_link_libraries(k2c_test_${id} PRIVATE k2c_impl_${id} k2c_testing)
  gtest_discover_tests(k2c_test_${id} DISCOVERY_MODE PRE_TEST
                       PROPERTIES LABELS "module${num};${arg_KIND}")

  # A tuner, for modules whose implementation offers configurations to choose from.
  if(EXISTS ${root}/autograder/${id}/tune_${name}.cu)
    add_executable(k2c_tune_${id} ${root}/autograder/${id}/tune_${name}.cu)
    target_link_libraries(k2c_tune_${id} PRIVATE k2c_impl_${id} k2c_cuda k2c_core)
  endif()

  if(benchmark_FOUND AND EXISTS ${root}/autograder/${id}/bench_${name}.cu)
    add_executable(k2c_bench_${id} ${root}/autograder/${id}/bench_${name}.cu)
    target_link_libraries(k2c_bench_${id} PRIVATE k2c_impl_${id} k2c_cuda benchmark::benchmark)
  endif()
endfunction()
