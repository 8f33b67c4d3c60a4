"""The argument types of each CUDA driver call defrag makes, as cuda-bindings' `driver` module takes them.

`EmulatedCuda` runs every entry point's arguments through `conform(name,
args)` first, so a call the real `cuda.bindings.driver` function would refuse
with a TypeError (or an OverflowError, or a ValueError) is refused the same
way on the emulated device, and a CPU test fails where the GPU would. (It
once took `cuLaunchKernel(..., extra=None)`, which the real binding refuses:
`extra` is a `void_ptr`, an integer.)

`SIGNATURES` names each call's parameters in order with how the binding
converts them (the first line of each function's docstring in cuda-bindings
12.x and 13.x; `tests/cpu/test_first_gpu_run.py` checks the table against the
installed binding and each rule against the real function):

- C integers (``unsigned int``, ``int``, ``size_t``, ``unsigned long long``,
  ``unsigned char``, ``void_ptr``): Cython's conversion: an int, or anything
  with ``__int__`` (a float is truncated); else TypeError "an integer is
  required"; out of the C type's range, OverflowError;
- handles (``CUstream``, ``CUdevice``, ...): None (NULL), an instance, or
  whatever the class's own constructor takes (the binding calls it);
- host pointers (``Any``: `dstHost`, `srcHost`, `p`, `image`): None, an object
  with the buffer protocol, or something ``int()`` takes within 0..2**64-1;
  else TypeError;
- `kernelParams`: None, an int (an address), a buffer, or a tuple of two tuples;
- enums (``attrib: CUdevice_attribute``): anything ``int()`` takes, not None, in the range Cython's
  conversion to the C enum takes;
- structs (``CUmemAllocationProp``): an instance or None; `desc`: None or a
  list/tuple of ``CUmemAccessDesc``; ``char *``: bytes or bytearray.

`conform` returns the arguments as the emulated device uses them: integers and
handles as ints (a handle None is 0), enums as ints, the rest as given.
"""

from __future__ import annotations

from cuda.bindings import driver as cu

__all__ = ["SIGNATURES", "conform", "parameters"]

_C_INTS = {  # kind -> (lowest, highest, the type's name in Cython's OverflowError)
    "unsigned int": (0, (1 << 32) - 1, "unsigned int"),
    "int": (-(1 << 31), (1 << 31) - 1, "int"),
    "size_t": (0, (1 << 64) - 1, "size_t"),
    "unsigned long long": (0, (1 << 64) - 1, "unsigned PY_LONG_LONG"),
    "unsigned char": (0, 255, "unsigned char"),
    "void_ptr": (0, (1 << 64) - 1, "unsigned PY_LONG_LONG"),
}

_ENUM_LOW, _ENUM_HIGH = -(1 << 30) + 1, (1 << 32) - 1

# name -> ((parameter, kind), ...): kinds are the C integer types above, "handle:<class>", "host",
# "kernelParams", "enum:<class>", "struct:<class>", "desc" and "char *".
SIGNATURES: dict[str, tuple[tuple[str, str], ...]] = {
    "cuInit": (("Flags", "unsigned int"),),
    "cuDriverGetVersion": (),
    "cuDeviceGetCount": (),
    "cuDeviceGet": (("ordinal", "int"),),
    "cuDeviceGetName": (("length", "int"), ("dev", "handle:CUdevice")),
    "cuDeviceTotalMem": (("dev", "handle:CUdevice"),),
    "cuDeviceGetAttribute": (("attrib", "enum:CUdevice_attribute"), ("dev", "handle:CUdevice")),
    "cuDevicePrimaryCtxRetain": (("dev", "handle:CUdevice"),),
    "cuDevicePrimaryCtxRelease": (("dev", "handle:CUdevice"),),
    "cuCtxSetCurrent": (("ctx", "handle:CUcontext"),),
    "cuCtxGetCurrent": (),
    "cuCtxSynchronize": (),
    "cuStreamSynchronize": (("hStream", "handle:CUstream"),),
    "cuStreamIsCapturing": (("hStream", "handle:CUstream"),),
    "cuMemGetInfo": (),
    "cuMemGetAllocationGranularity": (("prop", "struct:CUmemAllocationProp"),
                                      ("option", "enum:CUmemAllocationGranularity_flags")),
    "cuMemCreate": (("size", "size_t"), ("prop", "struct:CUmemAllocationProp"), ("flags", "unsigned long long")),
    "cuMemRelease": (("handle", "handle:CUmemGenericAllocationHandle"),),
    "cuMemAddressReserve": (("size", "size_t"), ("alignment", "size_t"), ("addr", "handle:CUdeviceptr"),
                            ("flags", "unsigned long long")),
    "cuMemAddressFree": (("ptr", "handle:CUdeviceptr"), ("size", "size_t")),
    "cuMemMap": (("ptr", "handle:CUdeviceptr"), ("size", "size_t"), ("offset", "size_t"),
                 ("handle", "handle:CUmemGenericAllocationHandle"), ("flags", "unsigned long long")),
    "cuMemUnmap": (("ptr", "handle:CUdeviceptr"), ("size", "size_t")),
    "cuMemSetAccess": (("ptr", "handle:CUdeviceptr"), ("size", "size_t"), ("desc", "desc"), ("count", "size_t")),
    "cuMemcpyDtoD": (("dstDevice", "handle:CUdeviceptr"), ("srcDevice", "handle:CUdeviceptr"),
                     ("ByteCount", "size_t")),
    "cuMemcpyDtoDAsync": (("dstDevice", "handle:CUdeviceptr"), ("srcDevice", "handle:CUdeviceptr"),
                          ("ByteCount", "size_t"), ("hStream", "handle:CUstream")),
    "cuMemsetD8Async": (("dstDevice", "handle:CUdeviceptr"), ("uc", "unsigned char"), ("N", "size_t"),
                        ("hStream", "handle:CUstream")),
    "cuMemAllocHost": (("bytesize", "size_t"),),
    "cuMemFreeHost": (("p", "host"),),
    "cuMemcpyDtoH": (("dstHost", "host"), ("srcDevice", "handle:CUdeviceptr"), ("ByteCount", "size_t")),
    "cuMemcpyHtoD": (("dstDevice", "handle:CUdeviceptr"), ("srcHost", "host"), ("ByteCount", "size_t")),
    "cuMemcpyDtoHAsync": (("dstHost", "host"), ("srcDevice", "handle:CUdeviceptr"), ("ByteCount", "size_t"),
                          ("hStream", "handle:CUstream")),
    "cuMemcpyHtoDAsync": (("dstDevice", "handle:CUdeviceptr"), ("srcHost", "host"), ("ByteCount", "size_t"),
                          ("hStream", "handle:CUstream")),
    "cuMemAlloc": (("bytesize", "size_t"),),
    "cuMemFree": (("dptr", "handle:CUdeviceptr"),),
    "cuEventCreate": (("Flags", "unsigned int"),),
    "cuEventRecord": (("hEvent", "handle:CUevent"), ("hStream", "handle:CUstream")),
    "cuEventSynchronize": (("hEvent", "handle:CUevent"),),
    "cuEventQuery": (("hEvent", "handle:CUevent"),),
    "cuEventDestroy": (("hEvent", "handle:CUevent"),),
    "cuModuleLoadData": (("image", "host"),),
    "cuModuleUnload": (("hmod", "handle:CUmodule"),),
    "cuModuleGetFunction": (("hmod", "handle:CUmodule"), ("name", "char *")),
    "cuFuncGetAttribute": (("attrib", "enum:CUfunction_attribute"), ("hfunc", "handle:CUfunction")),
    "cuOccupancyMaxActiveBlocksPerMultiprocessor": (("func", "handle:CUfunction"), ("blockSize", "int"),
                                                    ("dynamicSMemSize", "size_t")),
    "cuLaunchKernel": (("f", "handle:CUfunction"), ("gridDimX", "unsigned int"), ("gridDimY", "unsigned int"),
                       ("gridDimZ", "unsigned int"), ("blockDimX", "unsigned int"), ("blockDimY", "unsigned int"),
                       ("blockDimZ", "unsigned int"), ("sharedMemBytes", "unsigned int"),
                       ("hStream", "handle:CUstream"), ("kernelParams", "kernelParams"), ("extra", "void_ptr")),
}


def parameters(name: str) -> tuple[str, ...]:
    """The parameter names of driver call `name`, in order."""
    return tuple(p for p, _ in SIGNATURES[name])


def _has_buffer(value) -> bool:
    try:
        memoryview(value).release()
    except TypeError:
        return False
    return True


def _c_int(value, kind: str) -> int:
    lo, hi, cname = _C_INTS[kind]
    if type(value) is int:  # the common case first
        v = value
    elif isinstance(value, int) or hasattr(type(value), "__int__"):
        v = int(value)
    else:
        raise TypeError("an integer is required")
    if v < lo:
        raise OverflowError(f"can't convert negative value to {cname}" if lo == 0
                            else f"value too small to convert to {cname}")
    if v > hi:
        raise OverflowError(f"value too large to convert to {cname}" if hi < (1 << 63)
                            else "Python int too large to convert to C unsigned long")
    return v


def _handle(value, cls) -> int:
    if value is None:
        return 0
    if isinstance(value, cls):
        return int(value)
    return int(cls(value))  # the binding's own class decides what it takes, as the binding does


def _host(value):
    if value is None:
        return 0
    if isinstance(value, int) and 0 <= value < (1 << 64):
        return int(value)
    if _has_buffer(value):
        return value  # an object whose bytes the driver would read (the emulated device takes addresses only)
    if not isinstance(value, int) and hasattr(type(value), "__int__"):
        v = int(value)
        if 0 <= v < (1 << 64):
            return v
    raise TypeError(f"Provided argument is of type {type(value)} but expected Type {type(None)}, {type} or "
                    f"object with Buffer Protocol")


def _kernel_params(value):
    if value is None:
        return 0
    if isinstance(value, int):
        return _c_int(value, "void_ptr")
    if (isinstance(value, tuple) and len(value) == 2 and all(isinstance(v, tuple) for v in value)
            and len(value[0]) == len(value[1])):
        return value
    if _has_buffer(value):
        return value
    raise TypeError("Argument 'kernelParams' is not a valid type: tuple[tuple[Any, ...], tuple[Any, ...]] or "
                    "PyObject implimenting Buffer Protocol or Int")


def _converter(name: str, param: str, kind: str):
    """The function that converts one argument of `kind` (see `SIGNATURES`)."""
    if kind in _C_INTS:
        lo, hi, _ = _C_INTS[kind]

        def c_int(value):
            if type(value) is int and lo <= value <= hi:  # the common case: nothing to convert
                return value
            return _c_int(value, kind)
        return c_int
    what, _, cls_name = kind.partition(":")
    if what == "handle":
        cls = getattr(cu, cls_name)
        # A plain int in the C type's range is what the class takes anyway: no object made for it.
        lo, hi = (-(1 << 31), (1 << 31) - 1) if cls is cu.CUdevice else (0, (1 << 64) - 1)

        def handle(value):
            if type(value) is int and lo <= value <= hi:
                return value
            return _handle(value, cls)
        return handle
    if what == "enum":
        def enum(value):
            if value is None:
                raise TypeError(f"Argument '{param}' must not be None")
            v = int(value)
            # Cython's conversion to the C enum takes this range (measured on cuda-bindings 13.x).
            if not _ENUM_LOW <= v <= _ENUM_HIGH:
                raise OverflowError(f"value too large to convert to {cls_name}_enum")
            return v
        return enum
    if what == "struct":
        cls = getattr(cu, cls_name)

        def struct(value):
            if value is not None and not isinstance(value, cls):
                raise TypeError(f"Argument '{param}' has incorrect type (expected cuda.bindings.driver.{cls_name}, "
                                f"got {type(value).__name__})")
            return value
        return struct
    if kind == "host":
        return _host
    if kind == "kernelParams":
        return _kernel_params
    if kind == "desc":
        def desc(value):
            if value is not None and not (isinstance(value, (list, tuple))
                                          and all(isinstance(d, cu.CUmemAccessDesc) for d in value)):
                raise TypeError(f"Argument '{param}' is not instance of type (expected "
                                f"tuple[cydriver.CUmemAccessDesc,] or list[cydriver.CUmemAccessDesc,]")
            return value
        return desc
    if kind == "char *":
        def chars(value):
            if not isinstance(value, (bytes, bytearray)):
                raise TypeError(f"expected bytes, {type(value).__name__} found")
            return bytes(value)
        return chars
    raise AssertionError(f"unknown parameter kind {kind!r} of {name}")  # a mistake in SIGNATURES


_CONVERTERS = {name: tuple(_converter(name, param, kind) for param, kind in spec)
               for name, spec in SIGNATURES.items()}


def conform(name: str, args: tuple, kwargs: dict | None = None) -> tuple:
    """`args` (and `kwargs`, by parameter name) of driver call `name` checked as the real binding checks
    them (see the module docstring), returned as the emulated device takes them. Raises what the binding
    raises: TypeError (a wrong type, a wrong number of arguments), OverflowError, ValueError."""
    if kwargs:
        spec = SIGNATURES[name]
        names = [p for p, _ in spec]
        given = list(args)
        for param in names[len(given):]:
            if param not in kwargs:
                break
            given.append(kwargs.pop(param))
        if kwargs:
            raise TypeError(f"{name}() got an unexpected keyword argument {next(iter(kwargs))!r}")
        args = tuple(given)
    converters = _CONVERTERS[name]
    if len(args) != len(converters):
        raise TypeError(f"{name}() takes exactly {len(converters)} positional argument"
                        f"{'' if len(converters) == 1 else 's'} ({len(args)} given)")
    return tuple([convert(value) for convert, value in zip(converters, args)])
