"""Build the move kernel's GPU image for given architectures on a machine without a GPU, and check it.

    python tools/build_move_image.py [--arch sm_90 --arch sm_100 ...] [--toolkit DIR] [--libnvvm FILE] [--out DIR]

For each architecture a child process runs the library's own build, `kernels.image.build_move_image(cc)`
(numba-cuda compiles `_device.move_kernel` to PTX with libNVVM; the entry's PTX parameters are checked
against `kernels.abi.PARAMS`; the cubin goes through `image.cubin_bytes`), with numba's device queries
patched in that child only, never in the library:

- libNVVM is the toolkit's (default: a CUDA toolkit found from --toolkit, $CUDA_HOME, /usr/local/cuda,
  /usr/local/cuda-13.0; or --libnvvm / $DEFRAG_LIBNVVM), loaded before numba looks for one (as
  `kernels.arena.preload_libnvvm` does), so the PTX is no newer than that toolkit; CUDA_HOME is set to the
  toolkit (libdevice) and NUMBA_FORCE_CUDA_CC to the architecture (numba asks NVRTC for the supported
  architectures otherwise, and a toolkit need not ship NVRTC);
- the dispatcher's device (`get_current_device`), a code library's default architecture, and the
  kernel's module load (`_Kernel.bind`) answer without a driver;
- the cubin: numba's linker where it works here (nvJitLink installed), else the toolkit's `ptxas -v`
  assembles numba's PTX for the architecture, and the result is handed to `build_move_image` as numba-cuda
  0.30 hands it (a cuda.core `ObjectCode`).

Nothing is installed and no cache is written: the kernel cache (`move_image`) is not used. Each cubin is
then checked here: bytes, the ELF magic, the entry's name in its symbols and sections, and its
`.nv.info.<entry>` section's EIATTR_KPARAM_INFO records (19 parameters of 8 bytes at offsets 0, 8, ...,
as `kernels.abi` packs them; the EIATTR_PARAM_CBANK size 152); registers come from the image's
`.nv.info` EIATTR_REGCOUNT record for the entry's symbol (checked against ptxas's report), spills from
ptxas's report. One line per architecture; exit status 1 when a build or a check fails.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import struct
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

TOOLKITS = ("/usr/local/cuda", "/usr/local/cuda-13.0")
EIATTR_PARAM_CBANK = 0x0A
EIATTR_KPARAM_INFO = 0x17
EIATTR_REGCOUNT = 0x2F


# ---------------------------------------------------------------------------------------------- toolkit
def _libnvvm_in(toolkit: str) -> str | None:
    for pattern in ("nvvm/lib64/libnvvm.so*", "nvvm/lib/libnvvm.so*", "lib64/libnvvm.so*", "lib/libnvvm.so*"):
        found = sorted(glob.glob(os.path.join(toolkit, pattern)))
        if found:
            return found[-1]
    return None


def find_toolkit(toolkit: str | None = None, libnvvm: str | None = None) -> tuple[str | None, str | None, str]:
    """(toolkit folder, libNVVM file, why none) for a build: the first toolkit (given, $CUDA_HOME, TOOLKITS)
    holding libNVVM, libdevice and ptxas; `libnvvm` (or $DEFRAG_LIBNVVM) overrides the toolkit's libNVVM."""
    libnvvm = libnvvm or os.environ.get("DEFRAG_LIBNVVM") or None
    tried = []
    for candidate in ([toolkit] if toolkit else [os.environ.get("CUDA_HOME"), *TOOLKITS]):
        if not candidate or candidate in tried:
            continue
        tried.append(candidate)
        nvvm = libnvvm or _libnvvm_in(candidate)
        libdevice = os.path.join(candidate, "nvvm", "libdevice", "libdevice.10.bc")
        if nvvm and os.path.isfile(nvvm) and os.path.isfile(libdevice) \
                and os.access(os.path.join(candidate, "bin", "ptxas"), os.X_OK):
            return candidate, os.path.realpath(nvvm), ""
    return None, None, (f"no CUDA toolkit with libNVVM, nvvm/libdevice/libdevice.10.bc and bin/ptxas in "
                        f"{', '.join(tried) or 'nothing given'} (--toolkit DIR, --libnvvm FILE)")


def parse_arch(arch: str) -> tuple[int, int]:
    m = re.fullmatch(r"(?:sm_|compute_)?(\d+)(\d)", arch.strip())
    if not m:
        raise argparse.ArgumentTypeError(f"not an architecture: {arch!r} (e.g. sm_90)")
    return int(m.group(1)), int(m.group(2))


# ---------------------------------------------------------------------------------------------- the ELF
def elf_symbols(data: bytes, sections: dict[str, tuple[int, bytes]]) -> dict[str, int]:
    """{name: index} of the image's .symtab symbols."""
    strtab = sections.get(".strtab", (0, b""))[1]
    symtab = sections.get(".symtab", (0, b""))[1]
    out = {}
    for index in range(len(symtab) // 24):
        name, = struct.unpack_from("<I", symtab, 24 * index)
        out[strtab[name:strtab.index(b"\0", name)].decode(errors="replace")] = index
    return out


def elf_sections(data: bytes) -> dict[str, tuple[int, bytes]]:
    """{name: (sh_info, bytes)} of a 64-bit little-endian ELF's sections; ValueError where it is not one."""
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError("not a 64-bit little-endian ELF image")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    headers = []
    for i in range(shnum):
        name, _type, _flags, _addr, offset, size, _link, info = struct.unpack_from(
            "<IIQQQQII", data, shoff + i * shentsize)
        headers.append((name, offset, size, info))
    names_at, names_size = headers[shstrndx][1], headers[shstrndx][2]
    names = data[names_at:names_at + names_size]
    out = {}
    for name, offset, size, info in headers:
        label = names[name:names.index(b"\0", name)].decode(errors="replace")
        out[label] = (info, data[offset:offset + size])
    return out


def nv_info_records(section: bytes) -> list[tuple[int, int, bytes]]:
    """The (format, attribute, payload) records of an .nv.info section."""
    records, i = [], 0
    while i + 2 <= len(section):
        fmt, attr = section[i], section[i + 1]
        i += 2
        if fmt == 0x04:  # EIFMT_SVAL: a 16-bit size, then that many bytes
            size, = struct.unpack_from("<H", section, i)
            payload = section[i + 2:i + 2 + size]
            i += 2 + size
        elif fmt == 0x03:  # EIFMT_HVAL: a 16-bit value
            payload = section[i:i + 2]
            i += 2
        elif fmt == 0x02:  # EIFMT_BVAL: one byte (and one of padding: records are 4-byte aligned)
            payload = section[i:i + 1]
            i += 2
        else:  # EIFMT_NVAL: nothing (two bytes of padding)
            payload = b""
            i += 2
        records.append((fmt, attr, payload))
    return records


def check_cubin(data, entry: str, params: int = 19) -> dict:
    """What the cubin says about `entry` (bytes, parameters as (offset, size), the parameter bank's size,
    registers), and `problems`: every check that failed, in words."""
    problems = []
    facts = {"bytes": len(data) if isinstance(data, (bytes, bytearray)) else None, "params": None,
             "param_sizes": None, "cbank": None, "registers": None}
    if not isinstance(data, bytes):
        return {**facts, "problems": [f"the image is a {type(data).__name__}, not bytes"]}
    if not data.startswith(b"\x7fELF"):
        return {**facts, "problems": [f"no ELF magic: starts {data[:8]!r}"]}
    if entry.encode() not in data:
        problems.append(f"the entry name {entry} is not in the image")
    try:
        sections = elf_sections(data)
    except (ValueError, struct.error, IndexError) as exc:
        return {**facts, "problems": problems + [f"unreadable ELF: {exc}"]}
    symbol = elf_symbols(data, sections).get(entry)
    if symbol is None:
        problems.append(f"no symbol {entry} in .symtab")
    if f".text.{entry}" not in sections:
        problems.append(f"no .text.{entry} section")
    for fmt, attr, payload in nv_info_records(sections.get(".nv.info", (0, b""))[1]):
        if attr == EIATTR_REGCOUNT and len(payload) >= 8 and struct.unpack_from("<I", payload)[0] == symbol:
            facts["registers"] = struct.unpack_from("<II", payload)[1]
    if facts["registers"] is None:
        problems.append(f"no EIATTR_REGCOUNT for {entry} in .nv.info")
    info = sections.get(f".nv.info.{entry}")
    if info is None:
        problems.append(f"no .nv.info.{entry} section")
    else:
        kparams = []
        for fmt, attr, payload in nv_info_records(info[1]):
            if attr == EIATTR_KPARAM_INFO and len(payload) >= 12:
                _index, ordinal, offset, word = struct.unpack_from("<IHHI", payload)
                kparams.append((ordinal, offset, (word >> 18) & 0x3FFF))
            elif attr == EIATTR_PARAM_CBANK and len(payload) >= 8:
                facts["cbank"] = struct.unpack_from("<IHH", payload)[2]
        kparams.sort()
        facts["params"] = len(kparams)
        facts["param_sizes"] = sorted({size for _o, _off, size in kparams})
        expected = [(i, 8 * i, 8) for i in range(params)]
        if kparams != expected:
            problems.append(f"the entry's parameters are {kparams} (ordinal, offset, size), not {params} "
                            f"of 8 bytes at offsets 0, 8, ...")
        if facts["cbank"] != 8 * params:
            problems.append(f"the parameter bank is {facts['cbank']} bytes, not {8 * params}")
    return {**facts, "problems": problems}


# ---------------------------------------------------------------------------------------------- the child
def _child(arch: str, toolkit: str, libnvvm: str, out: str) -> int:
    """Build the image for `arch` with the library's build_move_image (patched for no GPU, here only);
    write the cubin to `out` and one JSON line of facts to stdout."""
    import ctypes

    cc = parse_arch(arch)
    ctypes.CDLL(libnvvm, mode=getattr(os, "RTLD_NOW", 2) | getattr(os, "RTLD_GLOBAL", 0x100))
    import defrag.kernels  # noqa: F401 - its numpy alias before numba.cuda is imported
    from defrag.kernels import arena, image
    from numba.cuda import codegen, cuda_paths, dispatcher

    class Device:  # what the dispatcher asks of the current device while it compiles
        compute_capability = cc
        id = 0

    # numba-cuda collects NVRTC's path with libdevice's; a build with FORCE_CUDA_CC needs no NVRTC
    real_nvrtc_path = cuda_paths._get_nvrtc_path

    def nvrtc_path():
        try:
            return real_nvrtc_path()
        except Exception:  # noqa: BLE001 - not installed: not needed here
            return cuda_paths._env_path_tuple("none (not needed: NUMBA_FORCE_CUDA_CC)", None)

    cuda_paths._get_nvrtc_path = nvrtc_path
    dispatcher.get_current_device = lambda: Device
    dispatcher._Kernel.bind = lambda self: None  # loads the module into a context: no driver here
    real_ensure_cc = codegen.CUDACodeLibrary._ensure_cc
    codegen.CUDACodeLibrary._ensure_cc = lambda self, c: cc if c is None else real_ensure_cc(self, c)
    arena.require_backend = lambda: False  # "not the simulator"; the real probe asks for a GPU

    how = {}
    real_get_cubin = codegen.CUDACodeLibrary.get_cubin

    def get_cubin(self, cc=None):
        try:
            cubin = real_get_cubin(self, cc=cc)
            how["linker"] = "numba's linker"
            return cubin
        except Exception as exc:  # noqa: BLE001 - no nvJitLink and no driver: the toolkit's ptxas
            how["linker_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        cc = self._ensure_cc(cc)
        sm = f"sm_{cc[0]}{cc[1]}{cc[2] if len(cc) > 2 else ''}"
        from cuda.core import ObjectCode

        with tempfile.TemporaryDirectory() as tmp:
            ptx, cubin = os.path.join(tmp, "move.ptx"), os.path.join(tmp, "move.cubin")
            with open(ptx, "w") as f:
                f.write(self.get_asm_str(cc=cc))
            proc = subprocess.run([os.path.join(toolkit, "bin", "ptxas"), "-v", f"-arch={sm}", ptx, "-o", cubin],
                                  capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError(f"ptxas -arch={sm} failed: {proc.stderr.strip()[-2000:]}")
            how["linker"] = f"ptxas ({toolkit})"
            how["ptxas_log"] = proc.stderr + proc.stdout
            with open(cubin, "rb") as f:
                return ObjectCode.from_cubin(f.read())  # as numba-cuda 0.30's get_cubin returns it

    codegen.CUDACodeLibrary.get_cubin = get_cubin

    start = time.perf_counter()
    built = image.build_move_image(cc)
    seconds = time.perf_counter() - start
    with open(out, "wb") as f:
        f.write(built.data)
    from cuda.bindings import nvvm

    log = how.get("ptxas_log", "")
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    registers = re.search(r"Used (\d+) registers", log)
    facts = {"arch": arch, "entry": built.entry, "abi_params": built.params, "origin": built.origin,
             "seconds": round(seconds, 2), "type": type(built.data).__name__, "linker": how.get("linker"),
             "linker_error": how.get("linker_error"), "nvvm": ".".join(map(str, nvvm.version())),
             "libnvvm": libnvvm, "ptxas_registers": int(registers.group(1)) if registers else None,
             "spill_stores": int(spills.group(1)) if spills else None,
             "spill_loads": int(spills.group(2)) if spills else None}
    print(json.dumps(facts))
    return 0


# ---------------------------------------------------------------------------------------------- the parent
def build(arch: str, toolkit: str, libnvvm: str, out_dir: str, timeout: float = 300.0) -> dict:
    """Build and check the image for `arch` in a child process; the facts, with `problems` (empty: ok)."""
    out = os.path.join(out_dir, f"move-{arch}.cubin")
    env = dict(os.environ, CUDA_HOME=toolkit, NUMBA_FORCE_CUDA_CC="{}.{}".format(*parse_arch(arch)),
               DEFRAG_LIBNVVM=libnvvm)
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    start = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", arch, "--toolkit", toolkit,
                               "--libnvvm", libnvvm, "--out", out], capture_output=True, text=True, env=env,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"arch": arch, "problems": [f"the build took over {timeout:.0f} s"]}
    wall = time.perf_counter() - start
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-6:]
        return {"arch": arch, "problems": ["the build failed: " + " | ".join(tail)]}
    facts = json.loads(lines[-1])
    facts["wall_seconds"] = round(wall, 1)
    with open(out, "rb") as f:
        data = f.read()
    from defrag.kernels import abi

    checked = check_cubin(data, facts["entry"], abi.PARAMS)
    facts.update(checked)
    if facts["abi_params"] != abi.PARAMS:
        facts["problems"].append(f"build_move_image says {facts['abi_params']} parameters, not {abi.PARAMS}")
    if facts["ptxas_registers"] is not None and facts["registers"] != facts["ptxas_registers"]:
        facts["problems"].append(f"the ELF says {facts['registers']} registers, ptxas {facts['ptxas_registers']}")
    facts["path"] = out
    return facts


def line(facts: dict) -> str:
    if "entry" not in facts:
        return f"{facts['arch']}: FAILED: {'; '.join(facts['problems'])}"
    spills = ("?" if facts.get("spill_stores") is None
              else f"{facts['spill_stores']} B stores / {facts['spill_loads']} B loads")
    sizes = "/".join(map(str, facts.get("param_sizes") or [])) or "?"
    verdict = "ok" if not facts["problems"] else "FAILED: " + "; ".join(facts["problems"])
    return (f"{facts['arch']}: {verdict}: {facts['bytes']} bytes ({facts['type']}, ELF), entry {facts['entry']}, "
            f"{facts['params']} parameters of {sizes} bytes (param bank {facts['cbank']} B), "
            f"{facts['registers']} registers, spills {spills}; NVVM {facts['nvvm']}, cubin by {facts['linker']}; "
            f"build {facts['seconds']:.1f} s ({facts['wall_seconds']:.1f} s with the child's imports)")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", action="append", default=[], help="sm_XY (repeatable; default sm_90 and sm_100)")
    parser.add_argument("--toolkit", default=None, help="a CUDA toolkit folder (libNVVM, libdevice, ptxas)")
    parser.add_argument("--libnvvm", default=None, help="the libNVVM file to compile with (default: the toolkit's)")
    parser.add_argument("--out", default=None, help="a folder to keep the cubins in (default: a temporary one)")
    parser.add_argument("--json", action="store_true", help="also print each architecture's facts as JSON")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return _child(args.child, args.toolkit, args.libnvvm, args.out)
    archs = args.arch or ["sm_90", "sm_100"]
    for arch in archs:
        parse_arch(arch)
    toolkit, libnvvm, why = find_toolkit(args.toolkit, args.libnvvm)
    if toolkit is None:
        print(f"build_move_image: {why}")
        return 1
    release = subprocess.run([os.path.join(toolkit, "bin", "ptxas"), "--version"], capture_output=True, text=True)
    release = re.search(r"release ([\d.]+), (V[\d.]+)", release.stdout)
    print(f"toolkit {os.path.realpath(toolkit)} ({'CUDA ' + ' '.join(release.groups()) if release else 'version ?'}), "
          f"libNVVM {libnvvm}")
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        out_dir = args.out or tmp
        os.makedirs(out_dir, exist_ok=True)
        for arch in archs:
            facts = build(arch, toolkit, libnvvm, out_dir)
            print(line(facts), flush=True)
            if args.json:
                print(json.dumps(facts))
            ok = ok and not facts["problems"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
