# Note in platform/include/trainstream/platform/sys_call.h: an errno value becomes
# words in the platform seam's sys_call files alone (thread-safe there; strerror is
# not). Fails on any other C++ source that calls strerror or builds the text from a
# std::error_category. Run as
#   cmake -DSOURCE_DIR=<source> -P errno_words_in_one_place.cmake
set(_offenders "")
foreach(_dir daemon client platform kernels python proto common)
  file(GLOB_RECURSE _sources RELATIVE ${SOURCE_DIR}
    ${SOURCE_DIR}/${_dir}/*.h ${SOURCE_DIR}/${_dir}/*.cc ${SOURCE_DIR}/${_dir}/*.cpp
    ${SOURCE_DIR}/${_dir}/*.cu)
  foreach(_f IN LISTS _sources)
    if(_f MATCHES "^platform/(include/trainstream/platform/)?sys_call")
      continue()
    endif()
    file(STRINGS ${SOURCE_DIR}/${_f} _hits REGEX "(strerror|generic_category|system_category)")
    foreach(_h IN LISTS _hits)
      list(APPEND _offenders "${_f}: ${_h}")
    endforeach()
  endforeach()
endforeach()
if(_offenders)
  list(JOIN _offenders "\n  " _msg)
  message(FATAL_ERROR "errno turned into words outside platform/sys_call (use "
                      "platform::ErrnoMessage, ErrnoText or ErrnoStatus):\n  ${_msg}")
endif()
