# cmake -DROOT=<repository root> -P check_kernels_includes.cmake
# Fails, listing each file and line, when a source under ROOT/kernels includes a header of the services or
# their libraries (cmake/Geofp8Layering.cmake says why).
if(NOT ROOT)
  message(FATAL_ERROR "usage: cmake -DROOT=<repository root> -P check_kernels_includes.cmake")
endif()
file(GLOB_RECURSE sources LIST_DIRECTORIES false
     ${ROOT}/kernels/*.h ${ROOT}/kernels/*.cc ${ROOT}/kernels/*.cu ${ROOT}/kernels/*.cuh
     ${ROOT}/kernels/*.hpp ${ROOT}/kernels/*.cpp)
if(NOT sources)
  message(FATAL_ERROR "no sources under ${ROOT}/kernels")
endif()
list(SORT sources)
set(forbidden "^[ \t]*#[ \t]*include[ \t]*[<\"](platform/|server/|worker/|client/|proto/|geofp8/v1/|grpc|google/protobuf/|yaml-cpp/|[^>\"]*\\.pb\\.h)")
set(problems)
foreach(f ${sources})
  file(STRINGS ${f} lines REGEX "^[ \t]*#[ \t]*include")
  foreach(line IN LISTS lines)
    if(line MATCHES "${forbidden}")
      file(RELATIVE_PATH rel ${ROOT} ${f})
      string(STRIP "${line}" line)
      list(APPEND problems "  ${rel}: ${line}")
    endif()
  endforeach()
endforeach()
list(LENGTH sources count)
if(problems)
  list(JOIN problems "\n" text)
  message(FATAL_ERROR "kernels/ is the numeric core and includes nothing of the services "
                      "(docs/developing.md, Layout):\n${text}")
endif()
message(STATUS "kernels/: ${count} sources, no service headers included")
