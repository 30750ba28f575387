# CMake toolchain for Debian's aarch64 cross compiler (g++-aarch64-linux-gnu), running the
# built tests under qemu-user (qemu-aarch64) with the cross sysroot as its library root.
#   cmake -S . -B build-arm64 -DCMAKE_TOOLCHAIN_FILE=tools/aarch64-linux-gnu.cmake -DATTNFAST_BUILD_TESTS=ON
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)

set(ATTNFAST_CROSS_PREFIX aarch64-linux-gnu- CACHE STRING "cross tool prefix")
set(ATTNFAST_CROSS_SYSROOT /usr/aarch64-linux-gnu CACHE PATH "target libraries (libc, libstdc++, libgomp)")
set(CMAKE_C_COMPILER ${ATTNFAST_CROSS_PREFIX}gcc)
set(CMAKE_CXX_COMPILER ${ATTNFAST_CROSS_PREFIX}g++)

# Libraries and headers from the target tree only; programs (the build tools) from the host.
set(CMAKE_FIND_ROOT_PATH ${ATTNFAST_CROSS_SYSROOT})
set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)
set(CMAKE_FIND_ROOT_PATH_MODE_LIBRARY ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_INCLUDE ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_PACKAGE ONLY)

# ctest (and try_run) run target programs through qemu; -L points its dynamic loader at the
# cross sysroot, so the test needs no static linking.
find_program(ATTNFAST_QEMU_AARCH64 NAMES qemu-aarch64 qemu-aarch64-static)
if(ATTNFAST_QEMU_AARCH64)
  set(CMAKE_CROSSCOMPILING_EMULATOR ${ATTNFAST_QEMU_AARCH64} -L ${ATTNFAST_CROSS_SYSROOT})
endif()
