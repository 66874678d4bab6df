# Note [One Status below the transport] (common/include/trainstream/status.h):
# only daemon/transport/ may include grpcpp or name a grpc:: type. Run as
#   cmake -DDAEMON_DIR=<source>/daemon -P no_grpc_below_transport.cmake
file(GLOB_RECURSE _sources RELATIVE ${DAEMON_DIR}
  ${DAEMON_DIR}/*.h ${DAEMON_DIR}/*.cc ${DAEMON_DIR}/*.cu)
set(_offenders "")
foreach(_f IN LISTS _sources)
  if(_f MATCHES "^transport/")
    continue()
  endif()
  file(STRINGS ${DAEMON_DIR}/${_f} _hits REGEX "(#include [<\"]grpc|grpc::|grpc\\.pb\\.h)")
  foreach(_h IN LISTS _hits)
    list(APPEND _offenders "daemon/${_f}: ${_h}")
  endforeach()
endforeach()
if(_offenders)
  list(JOIN _offenders "\n  " _msg)
  message(FATAL_ERROR "gRPC below daemon/transport/ (return trainstream::Status instead):\n  ${_msg}")
endif()
