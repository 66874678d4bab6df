# The C++ tests' common pieces, shared by tests/CMakeLists.txt and the Windows
# kernels build (cmake/windows): trainstream_test_main (Catch2's main, v2 or v3)
# and trainstream_add_test. Tests include "catch_compat.h" (tests/cpp) and never
# the Catch2 headers directly: Debian 12 ships Catch2 v2, Ubuntu 24.04 v3.
get_filename_component(_ts_repo_root ${CMAKE_CURRENT_LIST_DIR}/.. ABSOLUTE)
find_package(Catch2 REQUIRED)
if(Catch2_VERSION VERSION_GREATER_EQUAL 3)
  add_library(trainstream_test_main INTERFACE)
  target_link_libraries(trainstream_test_main INTERFACE Catch2::Catch2WithMain)
else()
  add_library(trainstream_test_main STATIC ${_ts_repo_root}/tests/cpp/catch_main_v2.cc)
  target_link_libraries(trainstream_test_main PUBLIC Catch2::Catch2)
endif()
target_include_directories(trainstream_test_main INTERFACE ${_ts_repo_root}/tests/cpp)
target_compile_definitions(trainstream_test_main INTERFACE
  TRAINSTREAM_BUILD_DIR="${CMAKE_BINARY_DIR}" TRAINSTREAM_SOURCE_DIR="${_ts_repo_root}")

# trainstream_add_test(<name> SOURCES ... LIBS ...): one test binary, registered
# with CTest under its own name.
# CASES "[tag]"...: one ctest entry per tag (name_tag), each of which may end with
# TS_SKIP(reason) (catch_compat.h), which ctest then reports as skipped.
function(trainstream_add_test name)
  cmake_parse_arguments(ARG "" "" "SOURCES;LIBS;CASES" ${ARGN})
  add_executable(${name} ${ARG_SOURCES})
  target_link_libraries(${name} PRIVATE trainstream_test_main ${ARG_LIBS})
  trainstream_set_warnings(${name})
  if(NOT ARG_CASES)
    add_test(NAME ${name} COMMAND ${name})
    set_tests_properties(${name} PROPERTIES TIMEOUT 600)
  endif()
  foreach(_case IN LISTS ARG_CASES)
    string(REGEX REPLACE "[][]" "" _suffix "${_case}")
    add_test(NAME ${name}_${_suffix} COMMAND ${name} "${_case}")
    set_tests_properties(${name}_${_suffix} PROPERTIES TIMEOUT 600
                         SKIP_REGULAR_EXPRESSION "TS_SKIPPED:" SKIP_RETURN_CODE 4)
  endforeach()
endfunction()
