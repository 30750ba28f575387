"""Scan a built extension for instructions a baseline x86-64 CPU lacks, outside the ISA kernels.

attnfast ships one binary for every x86-64 CPU: the drivers, dispatch and Cython bridge are
compiled for the baseline (x86-64 v1: SSE2), and only csrc/kernels/isa_avx2.cpp,
isa_avx512.cpp and isa_avx512bf16.cpp are compiled with -mavx2/-mfma/-mf16c/-mavx512*;
dispatch.cpp calls into them
only after cpuid says the CPU can run them. A non-baseline instruction anywhere else would
crash (SIGILL) an older CPU before dispatch gets a say. The classic way to get one is an
inline function or template (std:: or our own) instantiated in an AVX translation unit and
in a baseline one: both copies are COMDAT, the linker keeps one, possibly the AVX one.

The scan disassembles the extension with ``objdump -d --no-show-raw-insn -C`` and attributes
each instruction to the function (symbol) it sits in. A function counts as ISA-specific when
its demangled name contains ``isa_avx2::``, ``isa_avx512::`` or ``isa_avx512bf16::`` (the
namespaces of those files, anonymous namespaces and lambdas inside them included) or
``kernel_table_avx2`` / ``kernel_table_avx512`` / ``kernel_table_avx512bf16``. Every other function must be free of:

- VEX/EVEX-encoded instructions (AVX, AVX2, FMA, F16C, AVX-512: mnemonics starting with ``v``,
  e.g. vmovaps, vfmadd231ps, vpbroadcastd, vcvtph2ps, vzeroupper), ymm/zmm registers and
  AVX-512 mask registers (%k0-%k7, kmovw, kortestw, ...);
- BMI1/BMI2/LZCNT/POPCNT/MOVBE/ADX (andn, bextr, blsr, bzhi, shlx, sarx, pdep, mulx, ...);
- SSE3/SSSE3/SSE4.1/SSE4.2 (haddps, pshufb, pblendvb, ptest, roundss, pmulld, crc32, ...),
  which x86-64 v1 lacks as well.

``tzcnt`` is not flagged: GCC's generic tuning emits ``rep bsf`` for __builtin_ctz, which
objdump prints as tzcnt and which pre-BMI CPUs execute as bsf. ``cpuid`` and ``xgetbv`` are the
dispatch mechanism itself (xgetbv only after cpuid reports OSXSAVE) and are not flagged.

Usage: ``python tests/isa_scan.py [path/to/_ext*.so]`` (default: the installed extension, found
through attnfast._ext.__file__); exit status 1 and a list of offending functions on failure.
"""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
from collections import defaultdict

ISA_SPECIFIC_MARKERS = ("isa_avx2::", "isa_avx512::", "isa_avx512bf16::", "kernel_table_avx2",
                        "kernel_table_avx512")  # (kernel_table_avx512bf16 included)

_PREFIXES = {
    "lock", "rep", "repz", "repnz", "repe", "repne", "notrack", "bnd", "data16", "data32",
    "addr32", "addr16", "cs", "ds", "ss", "es", "fs", "gs", "xacquire", "xrelease", "rex",
    "rex.w", "{vex}", "{vex3}", "{evex}",
}
# Non-AVX mnemonics that begin with 'v' (VMX and segment verification).
_V_NOT_AVX = {
    "verr", "verw", "vmcall", "vmclear", "vmfunc", "vmlaunch", "vmptrld", "vmptrst", "vmread",
    "vmresume", "vmwrite", "vmxoff", "vmxon", "vmrun", "vmload", "vmsave", "vmmcall",
}
_GROUPS = {
    "BMI1": {"andn", "bextr", "blsi", "blsmsk", "blsr"},
    "BMI2": {"bzhi", "mulx", "pdep", "pext", "rorx", "sarx", "shlx", "shrx"},
    "LZCNT": {"lzcnt"},
    "POPCNT": {"popcnt"},
    "MOVBE": {"movbe"},
    "ADX": {"adcx", "adox"},
    "SSE3": {"addsubps", "addsubpd", "haddps", "haddpd", "hsubps", "hsubpd", "lddqu",
             "movddup", "movshdup", "movsldup", "fisttp", "fisttps", "fisttpl", "fisttpll",
             "monitor", "mwait"},
    "SSSE3": {"pabsb", "pabsw", "pabsd", "palignr", "phaddw", "phaddd", "phaddsw", "phsubw",
              "phsubd", "phsubsw", "pmaddubsw", "pmulhrsw", "pshufb", "psignb", "psignw",
              "psignd"},
    "SSE4.1": {"blendpd", "blendps", "blendvpd", "blendvps", "dppd", "dpps", "extractps",
               "insertps", "movntdqa", "mpsadbw", "packusdw", "pblendvb", "pblendw", "pcmpeqq",
               "pextrb", "pextrd", "pextrq", "pinsrb", "pinsrd", "pinsrq", "phminposuw",
               "pmaxsb", "pmaxsd", "pmaxud", "pmaxuw", "pminsb", "pminsd", "pminud", "pminuw",
               "pmovsxbw", "pmovsxbd", "pmovsxbq", "pmovsxwd", "pmovsxwq", "pmovsxdq",
               "pmovzxbw", "pmovzxbd", "pmovzxbq", "pmovzxwd", "pmovzxwq", "pmovzxdq",
               "pmuldq", "pmulld", "ptest", "roundps", "roundpd", "roundss", "roundsd"},
    "SSE4.2": {"pcmpestri", "pcmpestrm", "pcmpistri", "pcmpistrm", "pcmpgtq", "crc32"},
}
_BY_MNEMONIC = {m: group for group, names in _GROUPS.items() for m in names}
_WIDE_REG = re.compile(r"%(ymm|zmm)\d+")
_MASK_REG = re.compile(r"%k[0-7]\b")
_MASK_OP = re.compile(r"^k(and|andn|or|xor|xnor|not|mov|shiftl|shiftr|unpck|add|test|ortest)[bwdq]*$")
_FUNC = re.compile(r"^[0-9a-fA-F]+ <(.*)>:$")
_INSN = re.compile(r"^\s*[0-9a-fA-F]+:\s+(.*)$")


def is_isa_specific(function: str) -> bool:
    return any(marker in function for marker in ISA_SPECIFIC_MARKERS)


def classify(text: str) -> str | None:
    """The extension an instruction (objdump text, AT&T syntax) needs beyond x86-64 v1, or None."""
    tokens = text.split()
    while tokens and tokens[0] in _PREFIXES:
        tokens = tokens[1:]
    if not tokens or tokens[0].startswith("("):  # "(bad)"
        return None
    mnemonic, operands = tokens[0], " ".join(tokens[1:])
    if _MASK_REG.search(operands) or _MASK_OP.match(mnemonic):
        return "AVX-512 (mask registers)"
    if "%zmm" in operands:
        return "AVX-512 (zmm)"
    if mnemonic.startswith("v") and mnemonic not in _V_NOT_AVX:
        if mnemonic.startswith(("vfmadd", "vfmsub", "vfnmadd", "vfnmsub")):
            return "FMA"
        if mnemonic.startswith(("vcvtph2ps", "vcvtps2ph")):
            return "F16C"
        return "AVX/AVX2 (ymm)" if _WIDE_REG.search(operands) else "AVX (VEX-encoded)"
    if _WIDE_REG.search(operands):
        return "AVX (ymm)"
    group = _BY_MNEMONIC.get(mnemonic)
    if group is None and mnemonic[-1:] in ("b", "w", "l", "q"):  # AT&T size suffix
        group = _BY_MNEMONIC.get(mnemonic[:-1])
    return group


def objdump_path() -> str | None:
    return shutil.which("objdump")


def disassemble(path: str) -> str:
    return subprocess.run([objdump_path() or "objdump", "-d", "--no-show-raw-insn", "-C", path],
                          check=True, capture_output=True, text=True).stdout


def has_symbols(path: str) -> bool:
    """True when the file keeps its static symbol table (not stripped): without it objdump can
    name only the few exported functions and the scan cannot tell functions apart."""
    out = subprocess.run([objdump_path() or "objdump", "-t", path], check=True,
                         capture_output=True, text=True).stdout
    return "no symbols" not in out and len(out.splitlines()) > 20


def scan(path: str) -> dict:
    """{'violations': {function: {extension: [instructions...]}}, 'isa_functions': n,
    'functions': n, 'isa_instructions': n} for one shared object."""
    violations: dict = defaultdict(lambda: defaultdict(list))
    functions = isa_functions = isa_insns = 0
    current, specific = "<no symbol>", False
    for line in disassemble(path).splitlines():
        head = _FUNC.match(line)
        if head:
            current = head.group(1)
            specific = is_isa_specific(current)
            functions += 1
            isa_functions += specific
            continue
        insn = _INSN.match(line)
        if not insn:
            continue
        text = insn.group(1).split("#")[0].strip()
        ext = classify(text)
        if ext is None:
            continue
        if specific:
            isa_insns += 1
        else:
            violations[current][ext].append(text)
    return {"violations": {f: dict(e) for f, e in violations.items()}, "functions": functions,
            "isa_functions": isa_functions, "isa_instructions": isa_insns}


def report(result: dict, limit: int = 3) -> str:
    lines = []
    for function, exts in sorted(result["violations"].items()):
        for ext, insns in sorted(exts.items()):
            shown = "; ".join(insns[:limit]) + (f"; ... ({len(insns)} in all)" if len(insns) > limit else "")
            lines.append(f"  {function}: {ext}: {shown}")
    return "\n".join(lines)


def installed_extension() -> str:
    from attnfast import _ext
    return _ext.__file__


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    path = argv[0] if argv else installed_extension()
    if objdump_path() is None:
        print("objdump not found (install binutils)", file=sys.stderr)
        return 2
    if not has_symbols(path):
        print(f"{path} has no symbol table (stripped): cannot attribute instructions to "
              "functions", file=sys.stderr)
        return 2
    result = scan(path)
    print(f"{path}: {result['functions']} functions, {result['isa_functions']} in the AVX2/AVX-512 "
          f"kernels ({result['isa_instructions']} non-baseline instructions there)")
    if result["violations"]:
        print(f"FAIL: {len(result['violations'])} function(s) outside the ISA kernels use "
              "instructions a baseline x86-64 CPU lacks:")
        print(report(result))
        return 1
    print("OK: no non-baseline instruction outside the ISA kernels")
    return 0


if __name__ == "__main__":
    sys.exit(main())
