"""The installed extension runs on any x86-64 CPU: no AVX/AVX2/AVX-512/FMA/F16C/BMI/SSE3+
instruction outside the ISA-specific kernels (tests/isa_scan.py explains the rules)."""
import os
import platform
import shutil
import subprocess
import sys

import pytest

import isa_scan

X86_64 = platform.machine().lower() in ("x86_64", "amd64")

needs_objdump = pytest.mark.skipif(
    not (X86_64 and sys.platform.startswith("linux") and isa_scan.objdump_path()),
    reason="the ISA scan disassembles ELF x86-64 with GNU objdump (binutils): needs Linux x86-64 "
           "and objdump on PATH")


@pytest.mark.parametrize("text,expected", [
    ("vmovaps %ymm0,(%rdi)", "AVX/AVX2 (ymm)"),
    ("vaddss %xmm1,%xmm0,%xmm0", "AVX (VEX-encoded)"),
    ("vzeroupper", "AVX (VEX-encoded)"),
    ("vfmadd231ps %ymm2,%ymm1,%ymm0", "FMA"),
    ("vcvtph2ps (%rax),%ymm0", "F16C"),
    ("vpbroadcastd %xmm0,%ymm0", "AVX/AVX2 (ymm)"),
    ("vmovups %zmm0,(%rdi){%k1}", "AVX-512 (mask registers)"),
    ("kmovw %eax,%k1", "AVX-512 (mask registers)"),
    ("andn %rax,%rbx,%rcx", "BMI1"),
    ("shlx %rax,%rbx,%rcx", "BMI2"),
    ("bzhi %eax,%ebx,%ecx", "BMI2"),
    ("popcnt %rdi,%rax", "POPCNT"),
    ("lzcnt %rdi,%rax", "LZCNT"),
    ("pshufb %xmm1,%xmm0", "SSSE3"),
    ("roundss $0x9,%xmm1,%xmm0", "SSE4.1"),
    ("crc32q %rsi,%rax", "SSE4.2"),
    ("lock cmpxchg %rdx,(%rdi)", None),
    ("movaps %xmm0,(%rdi)", None),
    ("mulss %xmm1,%xmm0", None),
    ("pextrw $0x3,%xmm0,%eax", None),
    ("tzcnt %rax,%rax", None),   # GCC's `rep bsf`: runs as bsf without BMI
    ("xgetbv", None),
    ("cpuid", None),
    ("notrack jmp *%rax", None),
])
def test_classify(text, expected):
    assert isa_scan.classify(text) == expected


@needs_objdump
@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler (cc) to build the control")
def test_scan_flags_avx2_outside_the_kernels(tmp_path):
    """Negative control: an AVX2 function outside the kernel namespaces is reported by name,
    one inside attnfast::isa_avx2 is not."""
    src = tmp_path / "control.cpp"
    src.write_text(
        "#include <immintrin.h>\n"
        "namespace attnfast { namespace isa_avx2 {\n"
        "__attribute__((target(\"avx2,fma\"))) void ok(float* p) {\n"
        "  __m256 x = _mm256_loadu_ps(p); _mm256_storeu_ps(p, _mm256_fmadd_ps(x, x, x)); }\n"
        "}}\n"
        "__attribute__((target(\"avx2\"))) void leaked_inline(float* p) {\n"
        "  __m256 x = _mm256_loadu_ps(p); _mm256_storeu_ps(p, _mm256_add_ps(x, x)); }\n")
    lib = tmp_path / "control.so"
    subprocess.run(["cc", "-x", "c++", "-O2", "-shared", "-fPIC", str(src), "-o", str(lib)],
                   check=True, capture_output=True)
    result = isa_scan.scan(str(lib))
    assert list(result["violations"]) == ["leaked_inline(float*)"]
    assert result["isa_functions"] == 1 and result["isa_instructions"] > 0


@needs_objdump
def test_installed_extension_is_baseline_outside_the_kernels():
    path = isa_scan.installed_extension()
    assert isa_scan.has_symbols(path), (
        f"{path} is stripped: the scan needs the symbol table (pyproject.toml keeps it with "
        "[tool.scikit-build] install.strip = false)")
    result = isa_scan.scan(path)
    # The AVX2/AVX-512 tiers are compiled in on x86-64 GCC/Clang builds: the scan must see them,
    # or it is not looking at what it thinks it is.
    assert result["isa_functions"] > 0 and result["isa_instructions"] > 0, result
    assert not result["violations"], (
        "functions outside the AVX2/AVX-512 kernels use instructions a baseline x86-64 CPU "
        "lacks:\n" + isa_scan.report(result))


@pytest.mark.skipif(os.environ.get("ATTNFAST_EXPECT_OPENMP") != "1",
                    reason="set ATTNFAST_EXPECT_OPENMP=1 (release wheels: cibuildwheel, "
                           "tools/build_wheel.sh) to require an OpenMP build")
def test_built_with_openmp():
    """CMake falls back to a single-threaded build with only a warning when it cannot find
    OpenMP (e.g. a macOS runner without libomp): a release wheel must not ship like that."""
    from attnfast import _ext
    info = _ext.runtime_info()
    assert info["openmp"], f"attnfast was built without OpenMP: {info['openmp_runtime']}"
