"""An NCCL communicator for the NCCL backend, built from a torch.distributed process group.

Rank 0 of the group takes an NCCL unique id, the group broadcasts it (over whatever backend the process
group has), and every rank joins with ncclCommInitRank on its current CUDA device. NCCL is reached with
ctypes, through the library megamoe's NCCL backend is linked to (the one the nvidia-nccl pip package
brings, preloaded by megamoe._capi), so the C API needs nothing new.
"""
import atexit
import ctypes

import torch
import torch.distributed as dist

from megamoe import _capi
import megamoe


class _UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_char * 128)]  # NCCL_UNIQUE_ID_BYTES


def _nccl():
    lib = _capi.nccl_lib
    if lib is None:
        try:
            lib = ctypes.CDLL("libnccl.so.2", mode=ctypes.RTLD_GLOBAL)
        except OSError as e:
            raise megamoe.UnsupportedError(f"the NCCL backend needs libnccl.so.2: {e}", 8) from e
    lib.ncclGetUniqueId.argtypes = [ctypes.POINTER(_UniqueId)]
    lib.ncclCommInitRank.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, _UniqueId, ctypes.c_int]
    lib.ncclCommDestroy.argtypes = [ctypes.c_void_p]
    lib.ncclGetErrorString.argtypes = [ctypes.c_int]
    lib.ncclGetErrorString.restype = ctypes.c_char_p
    return lib


def _fail(lib, what, r):
    raise megamoe.NcclError(f"{what} failed: {lib.ncclGetErrorString(r).decode()} (ncclResult {r})", 11)


_comms = []  # communicators made here, destroyed at exit after the groups that use them


def nccl_comm_from_process_group(pg=None):
    """Creates an ncclComm_t spanning the ranks of `pg` (default: the world group), on the current CUDA
    device, as a megamoe.NcclComm (the package destroys it at exit). Collective: every rank of pg calls it."""
    if pg is not None and not isinstance(pg, dist.ProcessGroup):
        raise megamoe.ArgumentTypeError(f"pg: expected a torch.distributed.ProcessGroup or None, got {type(pg).__name__}", 1)
    lib = _nccl()
    pg = pg or dist.group.WORLD
    rank, world = dist.get_rank(pg), dist.get_world_size(pg)
    uid = _UniqueId()
    if rank == 0:
        r = lib.ncclGetUniqueId(ctypes.byref(uid))
        if r:
            _fail(lib, "ncclGetUniqueId", r)
    box = [bytes(uid.internal) if rank == 0 else None]
    dist.broadcast_object_list(box, src=dist.get_global_rank(pg, 0), group=pg,
                               device=torch.device("cuda", torch.cuda.current_device())
                               if dist.get_backend(pg) == "nccl" else None)
    uid = _UniqueId()
    ctypes.memmove(uid.internal, box[0], 128)
    comm = ctypes.c_void_p()
    r = lib.ncclCommInitRank(ctypes.byref(comm), world, uid, rank)
    if r:
        _fail(lib, "ncclCommInitRank", r)
    _comms.append(comm.value)
    return megamoe.NcclComm.unsafe_from_address(comm.value)


def destroy_comms():
    lib = _capi.nccl_lib
    while _comms:
        c = _comms.pop()
        if lib is not None:
            lib.ncclCommDestroy(c)


atexit.register(destroy_comms)
