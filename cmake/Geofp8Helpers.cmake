# Small helpers shared by every component's CMakeLists.txt.

# geofp8_test(NAME SOURCES a_test.cc ... LIBS lib ... [LABELS unit gpu ...] [TIMEOUT s])
# Builds a GoogleTest binary and registers each TEST with ctest under the given labels.
# Tests that need a GPU carry the label `gpu` and call GTEST_SKIP() when no device is present.
function(geofp8_test name)
  if(NOT GEOFP8_BUILD_TESTS)
    return()
  endif()
  cmake_parse_arguments(T "" "TIMEOUT" "SOURCES;LIBS;LABELS" ${ARGN})
  if(NOT T_TIMEOUT)
    set(T_TIMEOUT 300)
  endif()
  if(NOT T_LABELS)
    set(T_LABELS unit)
  endif()
  add_executable(${name} ${T_SOURCES})
  target_link_libraries(${name} PRIVATE ${T_LIBS} geofp8_config GTest::gtest_main GTest::gmock)
  gtest_discover_tests(${name}
    DISCOVERY_MODE PRE_TEST
    DISCOVERY_TIMEOUT 60
    PROPERTIES LABELS "${T_LABELS}" TIMEOUT ${T_TIMEOUT})
endfunction()

# geofp8_add_subdirectories(): adds every subfolder of the current source folder that has a
# CMakeLists.txt, in alphabetical order (server/, worker/, client/: one program or library each).
function(geofp8_add_subdirectories)
  file(GLOB children LIST_DIRECTORIES true ${CMAKE_CURRENT_SOURCE_DIR}/*)
  list(SORT children)
  foreach(child ${children})
    if(IS_DIRECTORY ${child} AND EXISTS ${child}/CMakeLists.txt)
      add_subdirectory(${child})
    endif()
  endforeach()
endfunction()
