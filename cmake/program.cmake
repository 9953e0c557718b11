# sparrow_launcher(PROGRAM): PROGRAM (an executable target) is built into
# build/libexec/, and build/bin/PROGRAM is a small launcher (core/launcher.cc)
# that blocks SIGINT and SIGTERM and execs it. The mask and a pending signal
# survive execve, so a signal sent while the dynamic loader maps LibTorch waits
# for the program's own handlers (core/cli.h) instead of killing it
# (docs/cli.md, "Signals"). Building PROGRAM builds both.
function(sparrow_launcher program)
  set_target_properties(${program} PROPERTIES RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/libexec)
  add_executable(${program}-launcher ${PROJECT_SOURCE_DIR}/core/launcher.cc)
  set_target_properties(${program}-launcher PROPERTIES OUTPUT_NAME ${program})
  target_compile_definitions(${program}-launcher PRIVATE SPARROW_PROGRAM="${program}")
  # Never instrumented: a sanitizer's runtime start-up in the launcher (tens
  # of ms) would be a window before the signals are blocked.
  if(CMAKE_CXX_FLAGS MATCHES "-fsanitize" OR SPARROW_FUZZ)
    target_compile_options(${program}-launcher PRIVATE -fno-sanitize=all)
    target_link_options(${program}-launcher PRIVATE -fno-sanitize=all)
  endif()
  add_dependencies(${program} ${program}-launcher)
endfunction()
