"""ctypes declarations of include/megamoe.h, and the loading of libmegamoe.so.

The structs below mirror the header field by field; keep them in the header's order. The library is
found, in this order: the MEGAMOE_LIBRARY environment variable (a path to libmegamoe.so, e.g. in a CMake
build folder), then the copy installed beside this file by `pip install .`.
"""
import ctypes
import glob
import json
import os
import warnings

MAX_DIMS = 8

# enum megamoe_status (values pinned by the header)
OK = 0
STATUS_NAMES = (
    "OK", "INVALID_ARGUMENT", "OUT_OF_MEMORY", "BAD_WEIGHT", "NOT_FINALIZED", "BAD_INPUT", "IO", "FORMAT",
    "UNSUPPORTED", "TIMEOUT", "CUDA", "NCCL", "INTERNAL",
)

# enum megamoe_dtype
DTYPE = {
    "BOOL": 1, "U8": 2, "I8": 3, "I16": 4, "U16": 5, "F16": 6, "BF16": 7, "I32": 8, "U32": 9, "F32": 10,
    "F64": 11, "I64": 12, "U64": 13, "F8_E4M3": 14, "F8_E5M2": 15,
}
DTYPE_NAME = {v: k for k, v in DTYPE.items()}

# enum megamoe_backend / megamoe_weight_format / megamoe_proj / megamoe_field / megamoe_naming
BACKEND = {"cpu": 0, "cuda": 1, "nccl": 2}
FORMAT = {"nvfp4": 0, "bf16": 1}
PROJ = {"gate": 0, "up": 1, "down": 2}
FIELD = {"weight": 0, "weight_scale": 1, "weight_scale_2": 2, "input_scale": 3}
NAMING = {0: "stacked", 1: "per_expert", 2: "compressed_tensors"}


class Tensor(ctypes.Structure):
    _fields_ = [
        ("dtype", ctypes.c_int),
        ("ndim", ctypes.c_int),
        ("shape", ctypes.c_int64 * MAX_DIMS),
        ("data", ctypes.c_void_p),
    ]


class GroupConfig(ctypes.Structure):
    _fields_ = [
        ("backend", ctypes.c_int),
        ("num_ranks", ctypes.c_int),
        ("device", ctypes.c_int),
        ("nccl_comm", ctypes.c_void_p),
        ("num_threads", ctypes.c_int),
    ]


class LayerConfig(ctypes.Structure):
    _fields_ = [
        ("name", ctypes.c_char_p),
        ("num_experts", ctypes.c_int),
        ("top_k", ctypes.c_int),
        ("hidden_size", ctypes.c_int),
        ("intermediate_size", ctypes.c_int),
        ("max_tokens", ctypes.c_int),
        ("format", ctypes.c_int),
        ("activations", ctypes.c_int),
        ("norm_eps", ctypes.c_float),
        ("norm_zero_centered", ctypes.c_int),
        ("norm_gain_center", ctypes.c_float),
        ("activation_clamp", ctypes.c_float),
        ("timeout_ms", ctypes.c_int),
        ("gemm_kernel", ctypes.c_int),
    ]


# enum megamoe_activations
ACTIVATIONS = {"bf16": 0, "nvfp4": 1}


class ForwardArgs(ctypes.Structure):
    _fields_ = [
        ("num_tokens", ctypes.c_int),
        ("x", ctypes.c_void_p),
        ("topk_ids", ctypes.c_void_p),
        ("topk_weights", ctypes.c_void_p),
        ("is_padding", ctypes.c_void_p),
        ("y", ctypes.c_void_p),
    ]


class MemoryInfo(ctypes.Structure):
    _fields_ = [
        ("weight_bytes", ctypes.c_uint64),
        ("checkpoint_bytes", ctypes.c_uint64),
        ("finalize_peak_bytes", ctypes.c_uint64),
        ("buffer_bytes", ctypes.c_uint64),
        ("workspace_bytes", ctypes.c_uint64),
    ]


class LayerInfo(ctypes.Structure):
    _fields_ = [
        ("prefix", ctypes.c_char * 256),
        ("format", ctypes.c_int),
        ("naming", ctypes.c_int),
        ("num_experts", ctypes.c_int),
        ("hidden_size", ctypes.c_int),
        ("intermediate_size", ctypes.c_int),
        ("has_norm", ctypes.c_int),
        ("bytes", ctypes.c_uint64),
    ]


class NamedTensor(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char_p), ("tensor", Tensor)]


ProgressFn = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_uint64, ctypes.c_uint64)

class QuantizeOptions(ctypes.Structure):
    _fields_ = [
        ("calib_tokens", ctypes.c_int),
        ("calib_seed", ctypes.c_uint64),
        ("activation_clamp", ctypes.c_float),
        ("progress", ProgressFn),
        ("progress_user", ctypes.c_void_p),
    ]


_P = ctypes.c_void_p
_I = ctypes.c_int
_S = ctypes.c_char_p

# name: (restype, argtypes)
_PROTOTYPES = {
    "megamoe_status_string": (_S, [_I]),
    "megamoe_version_string": (_S, []),
    "megamoe_dtype_name": (_S, [_I]),
    "megamoe_dtype_size": (ctypes.c_size_t, [_I]),
    "megamoe_group_config_init": (None, [ctypes.POINTER(GroupConfig)]),
    "megamoe_group_create": (_I, [ctypes.POINTER(GroupConfig), ctypes.POINTER(_P)]),
    "megamoe_group_destroy": (None, [_P]),
    "megamoe_group_last_error": (_S, [_P]),
    "megamoe_group_world_size": (_I, [_P]),
    "megamoe_group_local_ranks": (_I, [_P]),
    "megamoe_group_rank": (_I, [_P, _I]),
    "megamoe_backend_available": (_I, [_I]),
    "megamoe_group_buffer_bytes": (_I, [_P, _I, _I, _I, _I, _I, ctypes.POINTER(ctypes.c_uint64)]),
    "megamoe_layer_config_init": (None, [ctypes.POINTER(LayerConfig)]),
    "megamoe_layer_create": (_I, [_P, ctypes.POINTER(LayerConfig), ctypes.POINTER(_P)]),
    "megamoe_layer_destroy": (None, [_P]),
    "megamoe_layer_last_error": (_S, [_P]),
    "megamoe_layer_load_weight": (_I, [_P, _S, ctypes.POINTER(Tensor)]),
    "megamoe_layer_load_expert_weight": (_I, [_P, _I, _I, _I, ctypes.POINTER(Tensor)]),
    "megamoe_layer_load_norm_weight": (_I, [_P, ctypes.POINTER(Tensor)]),
    "megamoe_layer_finalize": (_I, [_P]),
    "megamoe_layer_forward": (_I, [_P, ctypes.POINTER(ForwardArgs), _P]),
    "megamoe_layer_check": (_I, [_P]),
    "megamoe_layer_memory": (_I, [_P, ctypes.POINTER(MemoryInfo)]),
    "megamoe_checkpoint_open": (_I, [_S, ctypes.POINTER(_P)]),
    "megamoe_checkpoint_close": (None, [_P]),
    "megamoe_checkpoint_last_error": (_S, [_P]),
    "megamoe_checkpoint_num_tensors": (_I, [_P]),
    "megamoe_checkpoint_tensor": (_I, [_P, _I, ctypes.POINTER(_S), ctypes.POINTER(Tensor)]),
    "megamoe_checkpoint_find": (_I, [_P, _S, ctypes.POINTER(Tensor)]),
    "megamoe_checkpoint_find_layers": (_I, [_P, ctypes.POINTER(LayerInfo), _I, ctypes.POINTER(_I)]),
    "megamoe_checkpoint_describe_layer": (_I, [_P, _S, ctypes.POINTER(LayerInfo)]),
    "megamoe_layer_load_checkpoint": (_I, [_P, _P, _S, ProgressFn, _P]),
    "megamoe_safetensors_write": (_I, [_S, ctypes.POINTER(NamedTensor), _I, ctypes.c_char_p, ctypes.c_size_t]),
    "megamoe_quantize_options_init": (None, [ctypes.POINTER(QuantizeOptions)]),
    "megamoe_quantize_checkpoint": (_I, [_S, _S, ctypes.POINTER(QuantizeOptions), ctypes.c_char_p, ctypes.c_size_t]),
    "megamoe_quantize_nvfp4": (_I, [_P, ctypes.c_int64, ctypes.c_int64, _P, _P, ctypes.POINTER(ctypes.c_float)]),
}


def _nccl_preload():
    """Makes an NCCL library global before libmegamoe.so (whose NCCL backend needs libnccl.so.2) loads:
    the one the nvidia-nccl pip package holds (the one torch uses), where it is installed."""
    path = os.environ.get("MEGAMOE_NCCL_LIBRARY")
    if not path:
        try:
            import nvidia.nccl  # noqa: F401  (the pip package torch's CUDA wheels bring)

            for d in list(getattr(nvidia.nccl, "__path__", [])):
                hits = sorted(glob.glob(os.path.join(d, "lib", "libnccl.so*")))
                if hits:
                    path = hits[0]
                    break
        except ImportError:
            pass
    if path:
        try:
            return ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        except OSError:
            return None
    return None


def library_path():
    env = os.environ.get("MEGAMOE_LIBRARY")
    if env:
        return env
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "libmegamoe.so")


def _load():
    path = library_path()
    if not os.path.exists(path):
        raise ImportError(
            f"megamoe: the C library was not found at {path}: install the package with `pip install .` "
            "from the repository, or set MEGAMOE_LIBRARY to a built libmegamoe.so")
    nccl = _nccl_preload()
    try:
        lib = ctypes.CDLL(path)
    except OSError as e:
        raise ImportError(f"megamoe: could not load {path}: {e}") from e
    for name, (res, args) in _PROTOTYPES.items():
        fn = getattr(lib, name)
        fn.restype = res
        fn.argtypes = args
    return lib, nccl


def _built_nccl():
    """The NCCL version ("2.28.9") the library's NCCL backend was compiled against, from
    megamoe_build.json beside it (python/CMakeLists.txt writes it); None without an NCCL backend or
    the file."""
    try:
        with open(os.path.join(os.path.dirname(library_path()), "megamoe_build.json")) as f:
            v = json.load(f).get("nccl")
        return v if isinstance(v, str) else None
    except (OSError, ValueError, AttributeError):
        return None


def _loaded_nccl(preloaded):
    """The version ("2.30.7") of the NCCL this process has loaded (ncclGetVersion), or None."""
    try:
        nccl = preloaded or ctypes.CDLL("libnccl.so.2")
        code = ctypes.c_int()
        if nccl.ncclGetVersion(ctypes.byref(code)) != 0:
            return None
    except (OSError, AttributeError):
        return None
    v = code.value
    return f"{v // 10000}.{v // 100 % 100}.{v % 100}" if v >= 20900 else f"{v // 1000}.{v // 100 % 10}.{v % 100}"


def nccl_mismatch(built, loaded):
    """The message for an NCCL other than the one the library was built against (the same major and
    minor version is required: NCCL's device API has no ABI stability across releases), or None."""
    if not built or not loaded or built.split(".")[:2] == loaded.split(".")[:2]:
        return None
    return (f"megamoe: libmegamoe.so's NCCL backend was built against NCCL {built}, but this process loaded NCCL "
            f"{loaded}; NCCL's device API is not compatible across releases, so the 'nccl' backend refuses to run. "
            f"Install NCCL {built} (e.g. the nvidia-nccl pip package of that version, or set MEGAMOE_NCCL_LIBRARY to "
            f"its libnccl.so.2), or build megamoe against NCCL {loaded}")


lib, nccl_lib = _load()
NCCL_BUILT = _built_nccl()
NCCL_LOADED = _loaded_nccl(nccl_lib) if NCCL_BUILT else None
NCCL_MISMATCH = nccl_mismatch(NCCL_BUILT, NCCL_LOADED)
if NCCL_MISMATCH:
    warnings.warn(NCCL_MISMATCH, RuntimeWarning, stacklevel=2)


def check_nccl_version():
    """Raises NcclError (at Group("nccl")) when the loaded NCCL is not the one the library was built for."""
    if NCCL_MISMATCH:
        import megamoe

        raise megamoe.NcclError(NCCL_MISMATCH, 11)
