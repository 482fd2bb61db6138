# The layering rule of docs/developing.md: kernels/ is the numeric core and depends on nothing of
# the services. Two checks:
# - geofp8_check_kernels_links(DIR), at configure time: no target defined under DIR links gRPC,
#   protobuf, yaml-cpp or prometheus-cpp, or a geofp8_ target defined outside DIR (platform/,
#   proto/, server/, ...) other than those of the top-level CMakeLists.txt: geofp8_config (the
#   include paths) and the third-party wrappers of Geofp8Dependencies.cmake (geofp8_openblas,
#   geofp8_nccl). A kernels target that links only such targets cannot reach a service.
# - cmake/check_kernels_includes.cmake (a script, run by ctest layering.kernels_includes): no
#   source under kernels/ includes a platform/, server/, worker/, client/ or proto/ header, a
#   generated API header (geofp8/v1/..., *.pb.h), or gRPC, protobuf or yaml-cpp.
# tests/cmake/ checks that both fail on a planted violation.

# Every buildsystem target defined in `dir` or below it.
function(_geofp8_targets_under dir out)
  get_property(targets DIRECTORY ${dir} PROPERTY BUILDSYSTEM_TARGETS)
  get_property(subdirs DIRECTORY ${dir} PROPERTY SUBDIRECTORIES)
  foreach(sub ${subdirs})
    _geofp8_targets_under(${sub} sub_targets)
    list(APPEND targets ${sub_targets})
  endforeach()
  set(${out} ${targets} PARENT_SCOPE)
endfunction()

function(geofp8_check_kernels_links dir)
  _geofp8_targets_under(${dir} targets)
  set(problems)
  foreach(t ${targets})
    get_target_property(type ${t} TYPE)
    set(links)
    if(NOT type STREQUAL "INTERFACE_LIBRARY")
      get_target_property(direct ${t} LINK_LIBRARIES)
      if(direct)
        list(APPEND links ${direct})
      endif()
    endif()
    get_target_property(iface ${t} INTERFACE_LINK_LIBRARIES)
    if(iface)
      list(APPEND links ${iface})
    endif()
    foreach(item ${links})
      # A static library's private dependencies appear as $<LINK_ONLY:name>.
      string(REGEX REPLACE "^\\$<LINK_ONLY:(.*)>$" "\\1" name "${item}")
      set(bad FALSE)
      string(TOLOWER "${name}" lower)
      if(lower MATCHES "grpc|protobuf|yaml|prometheus")
        set(bad TRUE)
      elseif(name MATCHES "^geofp8_")
        if(NOT TARGET ${name})
          set(bad TRUE)  # defined nowhere: not a kernels target
        else()
          get_target_property(src ${name} SOURCE_DIR)
          cmake_path(IS_PREFIX dir "${src}" NORMALIZE inside)
          if(NOT inside AND NOT src STREQUAL CMAKE_SOURCE_DIR)
            set(bad TRUE)
          endif()
        endif()
      endif()
      if(bad)
        get_target_property(src ${t} SOURCE_DIR)
        file(RELATIVE_PATH rel ${CMAKE_SOURCE_DIR} ${src})
        list(APPEND problems "  ${t} (${rel}) links ${name}")
      endif()
    endforeach()
  endforeach()
  if(problems)
    list(REMOVE_DUPLICATES problems)
    list(JOIN problems "\n" text)
    message(FATAL_ERROR "kernels/ is the numeric core and links nothing of the services "
                        "(docs/developing.md, Layout):\n${text}")
  endif()
endfunction()
