// Our own declarations of the part of NCCL's C ABI that gpucoll uses, written from NCCL's public nccl.h
// (2.18 .. 2.32). We never include nccl.h: NCCL is loaded at run time with dlopen (nccl_loader.h), so the
// package builds and imports where no NCCL is installed, and one process can share the libnccl.so.2 that
// torch or CuPy already loaded.
//
// Everything lives in namespace gpucoll so that a translation unit that also includes the real nccl.h
// (through some other library) sees no redefinition. The enum values and struct layouts are ABI: they
// must match NCCL's exactly, and only ever grow at the end as NCCL's do.
#pragma once

#include <climits>
#include <cstddef>
#include <cstdint>

#include "core/types.h"

// The CUDA runtime's stream handle is `struct CUstream_st*`; declaring the tag here keeps this header free
// of CUDA includes while staying the same type as cudaStream_t where cuda_runtime_api.h is included too.
struct CUstream_st;

namespace gpucoll {

using NcclStream = ::CUstream_st*;

struct ncclComm;  // opaque
using ncclComm_t = ncclComm*;

constexpr int kNcclUniqueIdBytes = 128;
struct ncclUniqueId {
  char internal[kNcclUniqueIdBytes];
};
static_assert(sizeof(ncclUniqueId) == 128, "ncclUniqueId is 128 bytes in every NCCL release");

// C enums are int-sized on the ABIs we build for; the fixed underlying type makes that explicit and lets
// ncclRedOp_t hold the dynamic values that ncclRedOpCreatePreMulSum returns.
enum ncclResult_t : int {
  ncclSuccess = 0,
  ncclUnhandledCudaError = 1,
  ncclSystemError = 2,
  ncclInternalError = 3,
  ncclInvalidArgument = 4,
  ncclInvalidUsage = 5,
  ncclRemoteError = 6,
  ncclInProgress = 7,  // non-blocking communicators: not an error, poll ncclCommGetAsyncError
  ncclTimeout = 8,     // recent releases only
  ncclNumResults = 9,
};

enum ncclRedOp_t : int {
  ncclSum = 0,
  ncclProd = 1,
  ncclMax = 2,
  ncclMin = 3,
  ncclAvg = 4,
  ncclNumOps = 5,  // first value of the dynamic ops created by ncclRedOpCreatePreMulSum
  ncclMaxRedOp = 0x7fffffff,
};

enum ncclDataType_t : int {
  ncclInt8 = 0,
  ncclUint8 = 1,
  ncclInt32 = 2,
  ncclUint32 = 3,
  ncclInt64 = 4,
  ncclUint64 = 5,
  ncclFloat16 = 6,
  ncclFloat32 = 7,
  ncclFloat64 = 8,
  ncclBfloat16 = 9,
  ncclFloat8e4m3 = 10,  // NCCL >= 2.24, sm_90 and newer
  ncclFloat8e5m2 = 11,  // NCCL >= 2.24, sm_90 and newer
  ncclNumTypes = 12,
};

enum ncclScalarResidence_t : int {
  ncclScalarDevice = 0,         // read on the device while the collective runs
  ncclScalarHostImmediate = 1,  // read on the host before ncclRedOpCreatePreMulSum returns
};

constexpr int kNcclConfigUndefInt = INT_MIN;
constexpr unsigned int kNcclApiMagic = 0xcafebeefu;
constexpr int kNcclSplitNoColor = -1;  // NCCL_SPLIT_NOCOLOR
// ncclCommShrink's flags: a healthy parent with nothing in flight; or one whose operations must be aborted first.
constexpr int kNcclShrinkDefault = 0;  // NCCL_SHRINK_DEFAULT
constexpr int kNcclShrinkAbort = 1;    // NCCL_SHRINK_ABORT

// The communicator configuration as NCCL 2.18 laid it out. NCCL reads `size` first and copies only that
// many bytes (capped at its own sizeof), and `version` tells it which fields the caller knew about; fields
// past our prefix keep the library's defaults. So this prefix works with every NCCL >= 2.18, including
// newer ones whose struct has grown. Add fields only at the end, in NCCL's order, and raise `version`.
struct ncclConfig_t {
  size_t size;
  unsigned int magic;
  unsigned int version;
  int blocking;
  int cgaClusterSize;
  int minCTAs;
  int maxCTAs;
  const char* netName;
  int splitShare;
};

// The equivalent of NCCL_CONFIG_INITIALIZER for our prefix: every attribute left to NCCL.
// Value-initialised: NCCL copies `size` bytes, tail padding included (it lands on 2.25's trafficClass, which
// NCCL resets for version < 2.25, but zero bytes are the only safe thing to hand over).
inline ncclConfig_t nccl_config_default() {
  ncclConfig_t c{};
  c.size = sizeof(ncclConfig_t);
  c.magic = kNcclApiMagic;
  c.version = 21800;
  c.blocking = kNcclConfigUndefInt;
  c.cgaClusterSize = kNcclConfigUndefInt;
  c.minCTAs = kNcclConfigUndefInt;
  c.maxCTAs = kNcclConfigUndefInt;
  c.netName = nullptr;
  c.splitShare = kNcclConfigUndefInt;
  return c;
}

// NCCL_VERSION(X,Y,Z) of nccl.h: releases before 2.9 used X*1000+Y*100+Z.
constexpr int nccl_version_code(int major, int minor, int patch) {
  return (major <= 2 && minor <= 8) ? major * 1000 + minor * 100 + patch : major * 10000 + minor * 100 + patch;
}

// gpucoll's element types and ops in NCCL's numbering.
constexpr ncclDataType_t to_nccl(DType t) {
  switch (t) {
    case DType::kF16:
      return ncclFloat16;
    case DType::kBF16:
      return ncclBfloat16;
    case DType::kF32:
      return ncclFloat32;
    case DType::kF64:
      return ncclFloat64;
    case DType::kI8:
      return ncclInt8;
    case DType::kU8:
      return ncclUint8;
    case DType::kI32:
      return ncclInt32;
    case DType::kI64:
      return ncclInt64;
    case DType::kF8E4M3:
      return ncclFloat8e4m3;
    case DType::kF8E5M2:
      return ncclFloat8e5m2;
  }
  return ncclNumTypes;
}

// NCCL numbers max before min; gpucoll's enum does the opposite, so this is not a cast.
constexpr ncclRedOp_t to_nccl(RedOp op) {
  switch (op) {
    case RedOp::kSum:
      return ncclSum;
    case RedOp::kProd:
      return ncclProd;
    case RedOp::kMin:
      return ncclMin;
    case RedOp::kMax:
      return ncclMax;
    case RedOp::kAvg:
      return ncclAvg;
  }
  return ncclNumOps;
}

// Function-pointer types, one per entry point, with nccl.h's signatures.
extern "C" {
using PFN_ncclGetVersion = ncclResult_t (*)(int* version);
using PFN_ncclGetErrorString = const char* (*)(ncclResult_t result);
using PFN_ncclGetLastError = const char* (*)(ncclComm_t comm);
using PFN_ncclGetUniqueId = ncclResult_t (*)(ncclUniqueId* uniqueId);
using PFN_ncclCommInitRank = ncclResult_t (*)(ncclComm_t* comm, int nranks, ncclUniqueId commId, int rank);
using PFN_ncclCommInitRankConfig = ncclResult_t (*)(ncclComm_t* comm, int nranks, ncclUniqueId commId, int rank,
                                                    ncclConfig_t* config);
using PFN_ncclCommFinalize = ncclResult_t (*)(ncclComm_t comm);
using PFN_ncclCommSplit = ncclResult_t (*)(ncclComm_t comm, int color, int key, ncclComm_t* newcomm,
                                           ncclConfig_t* config);
// NCCL >= 2.27: the communicator of the ranks not in excludeRanksList, called by those ranks only.
using PFN_ncclCommShrink = ncclResult_t (*)(ncclComm_t comm, int* excludeRanksList, int excludeRanksCount,
                                            ncclComm_t* newcomm, ncclConfig_t* config, int shrinkFlags);
using PFN_ncclCommDestroy = ncclResult_t (*)(ncclComm_t comm);
using PFN_ncclCommAbort = ncclResult_t (*)(ncclComm_t comm);
using PFN_ncclCommGetAsyncError = ncclResult_t (*)(ncclComm_t comm, ncclResult_t* asyncError);
using PFN_ncclCommCount = ncclResult_t (*)(const ncclComm_t comm, int* count);
using PFN_ncclCommCuDevice = ncclResult_t (*)(const ncclComm_t comm, int* device);
using PFN_ncclCommUserRank = ncclResult_t (*)(const ncclComm_t comm, int* rank);
using PFN_ncclAllReduce = ncclResult_t (*)(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype,
                                           ncclRedOp_t op, ncclComm_t comm, NcclStream stream);
using PFN_ncclBroadcast = ncclResult_t (*)(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype,
                                           int root, ncclComm_t comm, NcclStream stream);
using PFN_ncclReduce = ncclResult_t (*)(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype,
                                        ncclRedOp_t op, int root, ncclComm_t comm, NcclStream stream);
using PFN_ncclAllGather = ncclResult_t (*)(const void* sendbuff, void* recvbuff, size_t sendcount,
                                           ncclDataType_t datatype, ncclComm_t comm, NcclStream stream);
using PFN_ncclReduceScatter = ncclResult_t (*)(const void* sendbuff, void* recvbuff, size_t recvcount,
                                               ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm,
                                               NcclStream stream);
using PFN_ncclSend = ncclResult_t (*)(const void* sendbuff, size_t count, ncclDataType_t datatype, int peer,
                                      ncclComm_t comm, NcclStream stream);
using PFN_ncclRecv = ncclResult_t (*)(void* recvbuff, size_t count, ncclDataType_t datatype, int peer, ncclComm_t comm,
                                      NcclStream stream);
using PFN_ncclGroupStart = ncclResult_t (*)();
using PFN_ncclGroupEnd = ncclResult_t (*)();
using PFN_ncclRedOpCreatePreMulSum = ncclResult_t (*)(ncclRedOp_t* op, void* scalar, ncclDataType_t datatype,
                                                      ncclScalarResidence_t residence, ncclComm_t comm);
using PFN_ncclRedOpDestroy = ncclResult_t (*)(ncclRedOp_t op, ncclComm_t comm);
// Entry points added in NCCL 2.28; absent from older libraries.
using PFN_ncclAlltoAll = ncclResult_t (*)(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype,
                                          ncclComm_t comm, NcclStream stream);
using PFN_ncclGather = ncclResult_t (*)(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype,
                                        int root, ncclComm_t comm, NcclStream stream);
using PFN_ncclScatter = ncclResult_t (*)(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype,
                                         int root, ncclComm_t comm, NcclStream stream);
}

// X(name, required): the table nccl_loader.cc resolves. A required symbol that is missing makes the library
// unusable (reported, not thrown); an optional one is left null and callers check it.
#define GPUCOLL_NCCL_FUNCTIONS(X)   \
  X(ncclGetVersion, true)           \
  X(ncclGetErrorString, true)       \
  X(ncclGetLastError, true)         \
  X(ncclGetUniqueId, true)          \
  X(ncclCommInitRank, true)         \
  X(ncclCommInitRankConfig, true)   \
  X(ncclCommFinalize, true)         \
  X(ncclCommDestroy, true)          \
  X(ncclCommAbort, true)            \
  X(ncclCommGetAsyncError, true)    \
  X(ncclCommCount, true)            \
  X(ncclCommCuDevice, true)         \
  X(ncclCommUserRank, true)         \
  X(ncclAllReduce, true)            \
  X(ncclBroadcast, true)            \
  X(ncclReduce, true)               \
  X(ncclAllGather, true)            \
  X(ncclReduceScatter, true)        \
  X(ncclSend, true)                 \
  X(ncclRecv, true)                 \
  X(ncclGroupStart, true)           \
  X(ncclGroupEnd, true)             \
  X(ncclRedOpCreatePreMulSum, true) \
  X(ncclRedOpDestroy, true)         \
  X(ncclCommSplit, false)           \
  X(ncclCommShrink, false)          \
  X(ncclAlltoAll, false)            \
  X(ncclGather, false)              \
  X(ncclScatter, false)

}  // namespace gpucoll
