# SPDX-License-Identifier: Apache-2.0
# The warnings src/ and tools/ are built with (-Wall -Wextra -Wshadow); with
# TURNSTILE_WARNINGS_AS_ERRORS=ON (the default preset, whose build `make test` starts with the
# target turnstile_src_and_tools) any of them fails the build. Excepted: generated code (etcd's
# protobuf and gRPC stubs, in the build tree: compiled without -Werror and included as SYSTEM)
# and third-party headers (imported targets' include directories are SYSTEM already).
option(TURNSTILE_WARNINGS_AS_ERRORS "Fail the build of src/ and tools/ on a warning" OFF)

function(turnstile_strict_warnings)
  foreach(target IN LISTS ARGN)
    if(NOT TARGET ${target})
      continue()
    endif()
    target_compile_options(${target} PRIVATE -Wall -Wextra -Wshadow
                           $<$<BOOL:${TURNSTILE_WARNINGS_AS_ERRORS}>:-Werror>)
    get_target_property(sources ${target} SOURCES)
    get_target_property(source_dir ${target} SOURCE_DIR)
    foreach(source IN LISTS sources)
      cmake_path(ABSOLUTE_PATH source BASE_DIRECTORY ${source_dir} OUTPUT_VARIABLE path)
      cmake_path(IS_PREFIX PROJECT_BINARY_DIR ${path} generated)
      if(generated)
        set_source_files_properties(${path} TARGET_DIRECTORY ${target} PROPERTIES COMPILE_OPTIONS -Wno-error)
      endif()
    endforeach()
    get_target_property(include_dirs ${target} INCLUDE_DIRECTORIES)
    foreach(dir IN LISTS include_dirs)
      cmake_path(IS_PREFIX PROJECT_BINARY_DIR ${dir} generated)
      if(generated)
        target_include_directories(${target} SYSTEM BEFORE PRIVATE ${dir})
      endif()
    endforeach()
  endforeach()
endfunction()
