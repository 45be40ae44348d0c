# K2CTesting.cmake — k2c_discover_tests(target LABELS "a;b"): the one way a GoogleTest program's
# tests become CTest tests.
#
# Discovery runs the program with --gtest_list_tests when CTest starts (PRE_TEST: a build never
# runs test programs). CMake's default limit for that run is 5 seconds, and a program that links
# the CUDA libraries can take longer than that to start on a machine whose disk cache is cold
# (the dynamic loader reads hundreds of MB): the listing then fails and CTest stops before any
# test runs. The limit here fits a cold start with room to spare; a warm start takes well under
# a second, so nothing waits on it in the usual case. autograder/selftest/slow_start.cpp proves
# it: a test program that takes longer than CMake's default to start is discovered and run.
set(K2C_DISCOVERY_TIMEOUT 300 CACHE STRING "Seconds a test program may take to list its tests")

#
# LOCK name: the program's tests never run alongside another test holding the same lock. GPU
# tests take the lock "gpu": `make test` runs CTest with one job per core, and performance tests
# that shared the GPU with each other would measure each other, not the code under test.
#
# The labels and the lock are set by a file of our own that CTest reads after the discovered
# tests: CMake 3.25's discovery flattens list-valued PROPERTIES, so a test would keep only its
# first label and a lock given after them would be read as a property named after the label.
function(k2c_discover_tests target)
  cmake_parse_arguments(arg "" "LOCK" "LABELS" ${ARGN})
  gtest_discover_tests(${target} DISCOVERY_MODE PRE_TEST DISCOVERY_TIMEOUT ${K2C_DISCOVERY_TIMEOUT}
                       TEST_LIST ${target}_TESTS)
  set(props "LABELS \"${arg_LABELS}\"")
  if(arg_LOCK)
    string(APPEND props " RESOURCE_LOCK ${arg_LOCK}")
  endif()
  set(file ${CMAKE_CURRENT_BINARY_DIR}/${target}_properties.cmake)
  file(WRITE ${file} "if(${target}_TESTS)\n  set_tests_properties(\${${target}_TESTS} PROPERTIES ${props})\nendif()\n")
  set_property(DIRECTORY APPEND PROPERTY TEST_INCLUDE_FILES ${file})
endfunction()

# k2c_add_rank_test(name ranks program [args...]): a CTest test that runs `program` on `ranks` MPI
# ranks on the MPI backend, started the one way the course starts ranks (`k2c run`, which prints
# the mpirun command it runs). One such test at a time (RESOURCE_LOCK mpi): ranks busy-poll, and
# a small CI machine oversubscribed by parallel jobs would crawl towards the deadlines. A rank
# that waits on its peers for 60 s ends the job with the reason instead of hanging the suite.
function(k2c_add_rank_test name ranks)
  add_test(NAME ${name} COMMAND $<TARGET_FILE:k2c> run -np ${ranks} --backend mpi --timeout 60 ${ARGN})
  k2c_take_mpi_lock(${name})
endfunction()

# k2c_take_mpi_lock(test...): the tests run one at a time among those that take the lock "mpi"
# (see above). Their chain is the longest path through `make test` on a small machine, so their
# COST starts it first in a fresh build tree (CTest has no timings of its own there yet), beside
# the longest of the other tests rather than after them: the self-tests' big builds cost more
# or less than it (autograder/selftest/CMakeLists.txt), so that one of them runs at a time.
function(k2c_take_mpi_lock)
  set_tests_properties(${ARGN} PROPERTIES RESOURCE_LOCK mpi COST 160)
endfunction()
