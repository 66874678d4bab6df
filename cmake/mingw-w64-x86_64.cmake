# CMake toolchain file: 64-bit Windows binaries from Debian's MinGW-w64 cross
# compiler (scripts/windows-cross.sh, docs/windows.md).
#
# The -posix variant of the compiler, not -win32: its libstdc++ is built on
# winpthreads, so std::thread, std::mutex and std::condition_variable exist
# (the AdamW engine and the quantization kernels' thread split use them).
set(CMAKE_SYSTEM_NAME Windows)
set(CMAKE_SYSTEM_PROCESSOR x86_64)

set(_ts_mingw x86_64-w64-mingw32)
set(CMAKE_C_COMPILER ${_ts_mingw}-gcc-posix)
set(CMAKE_CXX_COMPILER ${_ts_mingw}-g++-posix)
set(CMAKE_RC_COMPILER ${_ts_mingw}-windres)

# Look for headers, libraries and packages only in the MinGW sysroot and in
# TRAINSTREAM_WINDOWS_PREFIX, where the script installs what it cross-built
# (Catch2 so far); programs (ninja, a host protoc later) come from the build
# machine.
set(CMAKE_FIND_ROOT_PATH /usr/${_ts_mingw})
if(TRAINSTREAM_WINDOWS_PREFIX)
  list(APPEND CMAKE_FIND_ROOT_PATH ${TRAINSTREAM_WINDOWS_PREFIX})
  list(APPEND CMAKE_PREFIX_PATH ${TRAINSTREAM_WINDOWS_PREFIX})
endif()
# try_compile projects read this file again: hand them the prefix too.
list(APPEND CMAKE_TRY_COMPILE_PLATFORM_VARIABLES TRAINSTREAM_WINDOWS_PREFIX)
set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)
set(CMAKE_FIND_ROOT_PATH_MODE_LIBRARY ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_INCLUDE ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_PACKAGE ONLY)

# Note [Static MinGW runtime]: libstdc++, libgcc and winpthreads are linked
# into each .exe, so a binary runs under wine64 (or on a Windows machine)
# without the MinGW DLLs beside it or on WINEPATH.
set(CMAKE_EXE_LINKER_FLAGS_INIT "-static")

# Tests run under wine64 (scripts/windows-check.sh); CTest and
# try_run use it too when they are called on the build machine.
find_program(_ts_wine64 wine64 PATHS /usr/lib/wine)
if(_ts_wine64)
  set(CMAKE_CROSSCOMPILING_EMULATOR ${_ts_wine64})
endif()
