# pyscore_kernel_table(texts isa_sources layers out): writes the CPU kernel table (csrc/common/dispatch.h) to `out`.
#   texts:       the kernel texts (csrc/<op>/*_simd.h); each defines PYSCORE_VEC_ENTRY(family) on every layer of its
#                "// pyscore-vec-layers:" line that is in `layers`
#   isa_sources: the ISA files compiled here (*_avx512.cpp, *_amx.cpp, *_avx2.cpp, *_neon.cpp); each defines
#                PYSCORE_ENTRY(family, layer) entry points
#   layers:      the vector layers this architecture builds (avx2 avx512, or neon)
# The families come from PYSCORE_KERNELS(op, family, result) in the op headers (csrc/<op>/*.h). Each family's rows
# are ordered amx, avx512, avx2, neon: highest tier first, as select_kernel walks them.
set(PYSCORE_LAYER_ORDER amx avx512 avx2 neon)
set(PYSCORE_LAYER_TIER_amx kAmx)
set(PYSCORE_LAYER_TIER_avx512 kAvx512)
set(PYSCORE_LAYER_TIER_avx2 kAvx2)
set(PYSCORE_LAYER_TIER_neon kNeon)

function(pyscore_kernel_table texts isa_sources layers out)
  # Families: op headers outside common/.
  file(GLOB headers CONFIGURE_DEPENDS ${PYSCORE_ROOT}/csrc/*/*.h)
  set(families "")
  set(includes "")
  foreach(header IN LISTS headers)
    if(header MATCHES "/csrc/common/")
      continue()
    endif()
    file(STRINGS ${header} lines REGEX "^PYSCORE_KERNELS\\(")
    foreach(line IN LISTS lines)
      if(NOT line MATCHES "^PYSCORE_KERNELS\\(([a-z0-9_]+), ([a-z0-9_]+),")
        message(FATAL_ERROR "${header}: cannot read '${line}' (PYSCORE_KERNELS(op, family, result);)")
      endif()
      list(APPEND families ${CMAKE_MATCH_2})
      file(RELATIVE_PATH rel ${PYSCORE_ROOT}/csrc ${header})
      list(APPEND includes ${rel})
    endforeach()
  endforeach()
  list(REMOVE_DUPLICATES includes)
  # A new entry point or family reconfigures (the sources are read here, not only compiled).
  set_property(DIRECTORY APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS ${headers} ${isa_sources})

  # Rows: "family|layer".
  set(rows "")
  foreach(text IN LISTS texts)
    file(STRINGS ${text} layers_line REGEX "^// pyscore-vec-layers:" LIMIT_COUNT 1)
    string(REGEX REPLACE "^// pyscore-vec-layers:" "" text_layers "${layers_line}")
    separate_arguments(text_layers UNIX_COMMAND "${text_layers}")
    file(STRINGS ${text} entry_lines REGEX "PYSCORE_VEC_ENTRY\\([a-z0-9_]+\\)")
    foreach(line IN LISTS entry_lines)
      string(REGEX MATCHALL "PYSCORE_VEC_ENTRY\\([a-z0-9_]+\\)" found "${line}")
      foreach(entry IN LISTS found)
        string(REGEX REPLACE "PYSCORE_VEC_ENTRY\\(([a-z0-9_]+)\\)" "\\1" family "${entry}")
        foreach(layer IN LISTS text_layers)
          if(layer IN_LIST layers)
            list(APPEND rows "${family}|${layer}|${text}")
          endif()
        endforeach()
      endforeach()
    endforeach()
  endforeach()
  foreach(source IN LISTS isa_sources)
    file(STRINGS ${source} entry_lines REGEX "PYSCORE_ENTRY\\([a-z0-9_]+, [a-z0-9]+\\)")
    foreach(line IN LISTS entry_lines)
      string(REGEX MATCHALL "PYSCORE_ENTRY\\([a-z0-9_]+, [a-z0-9]+\\)" found "${line}")
      foreach(entry IN LISTS found)
        string(REGEX REPLACE "PYSCORE_ENTRY\\(([a-z0-9_]+), ([a-z0-9]+)\\)" "\\1|\\2" row "${entry}")
        list(APPEND rows "${row}|${source}")
      endforeach()
    endforeach()
  endforeach()

  set(declarations "")
  set(selects "")
  set(table "")
  foreach(family IN LISTS families)
    set(family_rows "")
    foreach(layer IN LISTS PYSCORE_LAYER_ORDER)
      foreach(row IN LISTS rows)
        if(row MATCHES "^${family}\\|${layer}\\|")
          set(entry "${family}_${layer}")
          if(NOT entry IN_LIST family_rows)
            list(APPEND family_rows ${entry})
            set(tier ${PYSCORE_LAYER_TIER_${layer}})
            string(APPEND declarations "${family}_kernels::type ${entry}(const KernelKey&);\n")
            string(APPEND table "    {${family}_kernels::op_name, \"${family}\", \"${layer}\", CpuTier::${tier},\n"
                                "     [](DType d) { return covers_dtype(${entry}, d); }},\n")
          endif()
        endif()
      endforeach()
    endforeach()
    string(APPEND selects "template <>\n${family}_kernels::type select_kernel<${family}_kernels>(KernelKey key) {\n")
    if(family_rows)
      string(APPEND selects "  static const KernelRow<${family}_kernels::type> rows[] = {\n")
      foreach(entry IN LISTS family_rows)
        string(REGEX MATCH "[a-z0-9]+$" layer "${entry}")
        string(APPEND selects "      {CpuTier::${PYSCORE_LAYER_TIER_${layer}}, ${entry}},\n")
      endforeach()
      string(APPEND selects "  };\n  return first_covering(rows, key);\n}\n\n")
    else()
      string(APPEND selects "  return {};  // no layer of this architecture covers it\n}\n\n")
    endif()
  endforeach()
  foreach(row IN LISTS rows)
    string(REPLACE "|" ";" parts "${row}")
    list(GET parts 0 family)
    list(GET parts 2 where)
    if(NOT family IN_LIST families)
      message(FATAL_ERROR "${where}: entry point of '${family}', a family no op header declares (PYSCORE_KERNELS)")
    endif()
  endforeach()

  set(include_lines "")
  foreach(rel IN LISTS includes)
    string(APPEND include_lines "#include \"${rel}\"\n")
  endforeach()
  if(table)
    string(CONCAT table_code "namespace {\nconst KernelTableRow kRows[] = {\n${table}};\n}  // namespace\n\n"
                  "const KernelTableRow* kernel_table(size_t* n) {\n  *n = sizeof(kRows) / sizeof(kRows[0]);\n"
                  "  return kRows;\n}\n")
  else()
    set(table_code "const KernelTableRow* kernel_table(size_t* n) {\n  *n = 0;\n  return nullptr;\n}\n")
  endif()
  file(CONFIGURE OUTPUT ${out} @ONLY CONTENT "\
// Generated by cmake/kernel_table.cmake: the CPU kernel table of this architecture (see common/dispatch.h).
#include \"common/dispatch.h\"
@include_lines@
namespace pyscore {

@declarations@
@selects@@table_code@
}  // namespace pyscore
")
endfunction()

# pyscore_cpu_bindings(out): writes bind_cpu_ops(m) to `out`, binding every PYSCORE_BIND(op, launcher, args...) line
# of the op headers (csrc/<op>/*.h, common/op_args.h), so an op is bound by its header alone. Only pyscore._C
# compiles it (the kernel check harness shares the kernel sources and has no Python).
function(pyscore_cpu_bindings out)
  file(GLOB headers CONFIGURE_DEPENDS ${PYSCORE_ROOT}/csrc/*/*.h)
  set(includes "")
  set(bind_lines "")
  foreach(header IN LISTS headers)
    if(header MATCHES "/csrc/common/")
      continue()
    endif()
    file(STRINGS ${header} lines REGEX "^PYSCORE_BIND\\(")
    foreach(line IN LISTS lines)
      if(NOT line MATCHES "^PYSCORE_BIND\\(([a-z0-9_]+), ([a-z0-9_]+),")
        message(FATAL_ERROR "${header}: cannot read '${line}' (PYSCORE_BIND(op, launcher, argument types...);)")
      endif()
      string(APPEND bind_lines "  bind_op(m, \"${CMAKE_MATCH_1}\", ${CMAKE_MATCH_2}, ${CMAKE_MATCH_1}_bind_args{});\n")
      file(RELATIVE_PATH rel ${PYSCORE_ROOT}/csrc ${header})
      list(APPEND includes ${rel})
    endforeach()
  endforeach()
  list(REMOVE_DUPLICATES includes)
  set(include_lines "")
  foreach(rel IN LISTS includes)
    string(APPEND include_lines "#include \"${rel}\"\n")
  endforeach()
  set_property(DIRECTORY APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS ${headers})
  file(CONFIGURE OUTPUT ${out} @ONLY CONTENT "\
// Generated by cmake/kernel_table.cmake (pyscore_cpu_bindings): pyscore._C's op bindings, one per PYSCORE_BIND line.
#include \"common/bind_args.h\"
@include_lines@
namespace pyscore {

void bind_cpu_ops(pybind11::module_& m) {
@bind_lines@}

}  // namespace pyscore
")
endfunction()
