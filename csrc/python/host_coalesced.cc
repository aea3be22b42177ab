// Tensor fusion on the host backend (Communicator.all_reduce_coalesced, all_gather_coalesced): many arrays of one
// dtype move in one native call and as few collectives as the staging bound allows, instead of one collective per
// array. A 1 KiB all-reduce costs its fixed part (call check, step hand-offs between ranks) almost whole; a thousand
// of them cost a thousand times that, one 1 MiB all-reduce little more than once (bench/fusion.py).
//
// The collectives a coalesced call makes depend only on the arrays' sizes and dtype, never on where they live: the
// concatenated vector is cut into chunks of `chunk_bytes` at the same offsets on every rank, and each chunk is one
// all-reduce. A chunk whose arrays are one contiguous span of memory (consecutive views of one buffer) is reduced
// in place there; any other chunk is gathered from and scattered into the arrays by the host backend itself
// (CollArgs::segs: no staging copy; all_gather_coalesced still stages). One rank may thus go
// zero-copy where another stages, and their calls still pair.
//
// Mismatched lists must fail on every rank, never return plausible numbers. A call of one chunk carries its total
// in the count of its collective, which the host backend's call check compares across ranks. Several chunks cannot:
// a rank whose total is a multiple of the chunk would end where another goes on, each chunk count agreeing. Those
// calls first exchange every rank's total in a small collective of another kind (check_totals: one that would meet
// a one-chunk call's data collective and fail the call check there), and every rank compares the same numbers.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <mutex>
#include <vector>

#include "backends/host/host_comm.h"
#include "backends/host/kernels.h"
#include "core/error.h"
#include "python/bindings.h"

namespace py = pybind11;

namespace gpucoll::python {
namespace {

// One array's memory (zero-byte arrays are left out: they have no place in the packed vector).
struct Piece {
  char* ptr;
  int64_t bytes;
};

// A contiguous run of the packed vector: [begin, end) of `pieces`, the first entered `skip` bytes in, `bytes` long.
struct Span {
  size_t begin = 0;
  int64_t skip = 0;
  int64_t bytes = 0;
};

// Whether `s` is one contiguous range of memory (then it can be reduced where it is).
bool in_place(const std::vector<Piece>& pieces, const Span& s) {
  const char* next = pieces[s.begin].ptr + s.skip;
  int64_t left = s.bytes;
  for (size_t i = s.begin; left > 0; ++i) {
    const Piece& p = pieces[i];
    const int64_t off = i == s.begin ? s.skip : 0;
    if (p.ptr + off != next) return false;
    const int64_t take = std::min(left, p.bytes - off);
    next = p.ptr + off + take;
    left -= take;
  }
  return true;
}

// Copies the span between the arrays and `staging` (pack: into staging; else back out).
void copy_span(const std::vector<Piece>& pieces, const Span& s, char* staging, bool pack) {
  int64_t done = 0;
  for (size_t i = s.begin; done < s.bytes; ++i) {
    const Piece& p = pieces[i];
    const int64_t off = i == s.begin ? s.skip : 0;
    const int64_t take = std::min(s.bytes - done, p.bytes - off);
    if (pack) {
      host::copy_bytes(staging + done, p.ptr + off, static_cast<size_t>(take));
    } else {
      host::copy_bytes(p.ptr + off, staging + done, static_cast<size_t>(take));
    }
    done += take;
  }
}

// Raises the same InvalidArgument on every rank when the ranks' totals differ (see the top of the file). The check
// must be a collective that no data call of the same coalesced call can pair with: an all-gather of the totals
// before an all-reduce's chunks; before an all-gather's chunks, an all-reduce (max) of each rank's total and its
// negation, which gives every rank the largest and the smallest.
void check_totals(host::HostComm& c, int64_t total, int local_size, algo::Coll data, const char* what) {
  host::CollArgs args;
  args.dtype = DType::kI64;
  args.local_size = local_size;
  args.auto_algo = true;
  std::string table;
  if (data == algo::Coll::kAllReduce) {
    std::vector<int64_t> all(static_cast<size_t>(c.nranks()));
    args.coll = algo::Coll::kAllGather;
    args.in = &total;
    args.out = all.data();
    args.count = 1;
    c.run(args, c.auto_algorithm(args.coll, static_cast<int64_t>(sizeof(int64_t)) * c.nranks(), local_size));
    if (std::all_of(all.begin(), all.end(), [&](int64_t t) { return t == all[0]; })) return;
    for (size_t r = 0; r < all.size(); ++r) table += (r ? ", " : "") + std::to_string(all[r]);
    table = "elements per rank: " + table;
  } else {
    int64_t range[2] = {total, -total};
    args.coll = algo::Coll::kAllReduce;
    args.op = RedOp::kMax;
    args.in = range;
    args.out = range;
    args.count = 2;
    c.run(args, c.auto_algorithm(args.coll, static_cast<int64_t>(sizeof(range)), local_size));
    if (range[0] == -range[1]) return;
    table = "from " + std::to_string(-range[1]) + " to " + std::to_string(range[0]) + " elements per rank";
  }
  GPUCOLL_INVALID_ARG(what, ": the ranks passed lists of different total sizes (", table,
                      "); every rank must pass arrays of the same sizes, in the same order");
}

// The whole coalesced all-reduce, without the GIL. It stages nothing (the staging buffer is all_gather's).
void all_reduce_pieces(host::HostComm& c, const std::vector<Piece>& pieces, DType dtype, RedOp op, int local_size,
                       int64_t chunk_bytes, std::vector<char>* /*staging*/) {
  const int64_t esize = static_cast<int64_t>(dtype_size(dtype));
  int64_t total_bytes = 0;
  for (const Piece& p : pieces) total_bytes += p.bytes;
  const int64_t chunk = std::max<int64_t>(esize, chunk_bytes / esize * esize);
  if (total_bytes > chunk) {
    check_totals(c, total_bytes / esize, local_size, algo::Coll::kAllReduce, "all_reduce_coalesced");
  }
  host::CollArgs args;
  args.coll = algo::Coll::kAllReduce;
  args.dtype = dtype;
  args.op = op;
  args.local_size = local_size;
  args.auto_algo = true;
  if (total_bytes == 0) {
    // Still one collective: a rank with nothing must meet a rank with something in the call check, not skip it.
    c.run(args, c.auto_algorithm(algo::Coll::kAllReduce, 0, local_size));
    return;
  }
  Span s;
  for (int64_t start = 0; start < total_bytes; start += s.bytes) {
    s.bytes = std::min(chunk, total_bytes - start);
    // auto_algorithm waits for this communicator's queued operations first (async calls of it), which may write
    // the arrays about to be packed.
    const algo::Algorithm& a = c.auto_algorithm(algo::Coll::kAllReduce, s.bytes, local_size);
    args.count = s.bytes / esize;
    // One contiguous range is reduced where it is; any other chunk too, through the arrays themselves: the host
    // backend's copy-in gathers from them and its writes of the result scatter into them (CollArgs::segs).
    std::vector<host::IoSeg> segs;
    if (in_place(pieces, s)) {
      args.in = pieces[s.begin].ptr + s.skip;
      args.out = const_cast<void*>(args.in);
      args.segs = nullptr;
      args.nsegs = 0;
    } else {
      int64_t left = s.bytes;
      for (size_t i = s.begin; left > 0; ++i) {
        const int64_t off = i == s.begin ? s.skip : 0;
        const int64_t take = std::min(left, pieces[i].bytes - off);
        segs.push_back({pieces[i].ptr + off, take / esize});
        left -= take;
      }
      args.segs = segs.data();
      args.nsegs = static_cast<int64_t>(segs.size());
    }
    c.run(args, a);
    // The next chunk starts where this one ended.
    int64_t left = s.bytes + s.skip;
    while (s.begin < pieces.size() && left >= pieces[s.begin].bytes) left -= pieces[s.begin++].bytes;
    s.skip = left;
  }
}

// The coalesced all-gather, without the GIL: input i of every rank lands in output i (`outs[i]`, world size times
// its bytes) in rank order. Always staged: an output's rank blocks are apart by the array, the gathered chunk's by
// the chunk, so the pieces would line up only for a single array. A chunk of `chunk_bytes` holds this rank's
// piece and every rank's gathered copy of it.
void all_gather_pieces(host::HostComm& c, const std::vector<Piece>& ins, const std::vector<char*>& outs, DType dtype,
                       int local_size, int64_t chunk_bytes, std::vector<char>* staging) {
  const int64_t esize = static_cast<int64_t>(dtype_size(dtype));
  const int nranks = c.nranks();
  int64_t total_bytes = 0;
  for (const Piece& p : ins) total_bytes += p.bytes;
  const int64_t chunk = std::max<int64_t>(esize, chunk_bytes / (nranks + 1) / esize * esize);
  if (total_bytes > chunk) {
    check_totals(c, total_bytes / esize, local_size, algo::Coll::kAllGather, "all_gather_coalesced");
  }
  // Rank r's block of every output, as pieces in the packed order of the inputs.
  std::vector<std::vector<Piece>> blocks(static_cast<size_t>(nranks));
  for (int r = 0; r < nranks; ++r) {
    for (size_t i = 0; i < ins.size(); ++i) blocks[r].push_back({outs[i] + r * ins[i].bytes, ins[i].bytes});
  }
  host::CollArgs args;
  args.coll = algo::Coll::kAllGather;
  args.dtype = dtype;
  args.local_size = local_size;
  args.auto_algo = true;
  Span s;
  int64_t start = 0;
  do {  // once at least: an empty call still meets the other ranks' calls
    s.bytes = std::min(chunk, total_bytes - start);
    const algo::Algorithm& a = c.auto_algorithm(algo::Coll::kAllGather, s.bytes * nranks, local_size);
    const size_t need = static_cast<size_t>(s.bytes * (nranks + 1));
    if (staging->size() < need) staging->resize(need);
    char* mine = staging->data();
    char* gathered = mine + s.bytes;
    if (s.bytes > 0) copy_span(ins, s, mine, true);
    args.in = mine;
    args.out = gathered;
    args.count = s.bytes / esize;
    c.run(args, a);
    for (int r = 0; r < nranks && s.bytes > 0; ++r) copy_span(blocks[r], s, gathered + r * s.bytes, false);
    int64_t left = s.bytes + s.skip;
    while (s.begin < ins.size() && left >= ins[s.begin].bytes) left -= ins[s.begin++].bytes;
    s.skip = left;
    start += s.bytes;
  } while (start < total_bytes);
}

// The arrays of a coalesced call as the host backend reads them: (pieces, dtype), or the index of the first array
// it cannot read, whose dtype is not the first's, or that overlaps another (the Python path then names the problem).
struct Read {
  std::vector<Piece> pieces;
  DType dtype = DType::kF32;
  py::ssize_t declined = -1;
};

// The index of an array that shares memory with another, or -1. Lists are usually in address order (views of one
// buffer, arrays allocated one after the other), which one pass confirms; others are sorted.
py::ssize_t first_overlap(const std::vector<Piece>& pieces) {
  std::vector<size_t> order;
  order.reserve(pieces.size());
  for (size_t i = 0; i < pieces.size(); ++i) {
    if (pieces[i].bytes > 0) order.push_back(i);
  }
  auto before = [&](size_t a, size_t b) { return pieces[a].ptr < pieces[b].ptr; };
  if (!std::is_sorted(order.begin(), order.end(), before)) std::sort(order.begin(), order.end(), before);
  for (size_t k = 1; k < order.size(); ++k) {
    const Piece& lo = pieces[order[k - 1]];
    if (lo.ptr + lo.bytes > pieces[order[k]].ptr) return static_cast<py::ssize_t>(std::max(order[k - 1], order[k]));
  }
  return -1;
}

Read read_arrays(const py::sequence& arrays) {
  Read r;
  const py::ssize_t n = static_cast<py::ssize_t>(arrays.size());
  r.pieces.reserve(static_cast<size_t>(n));
  HostArrayView view;  // read one at a time: the caller keeps the arrays alive, which keeps their memory
  for (py::ssize_t i = 0; i < n; ++i) {
    if (!view.read(arrays[i]) || (i > 0 && view.dtype != r.dtype)) {
      r.declined = i;
      return r;
    }
    r.dtype = view.dtype;
    r.pieces.push_back({static_cast<char*>(view.data), view.count * static_cast<int64_t>(dtype_size(view.dtype))});
  }
  r.declined = first_overlap(r.pieces);
  return r;
}

// A host communicator's staging buffer for coalesced calls, owned by its Python backend object (gpucoll/backends/
// host.py) so that it goes with it. Synchronous calls share it; an async_op=True call runs on the progress thread
// with a staging buffer of its own, so neither waits for the other to pack.
class HostCoalescer {
 public:
  explicit HostCoalescer(int64_t chunk_bytes) : chunk_bytes_(chunk_bytes) {
    GPUCOLL_CHECK_ARG(chunk_bytes >= 8, "chunk_bytes must be at least 8; got ", chunk_bytes);
  }

  // None when it ran; a Work for async_op; the index of the first array it declined, having run nothing.
  py::object all_reduce(host::HostComm& c, const py::sequence& arrays, RedOp op, int local_size, bool async_op) {
    Read r = read_arrays(arrays);
    if (r.declined >= 0) return py::int_(r.declined);
    return run(c, std::move(r.pieces), r.dtype, op, local_size, async_op, arrays);
  }

  // The same for arrays resolved in Python: (pointer, bytes) each, all of `dtype`.
  py::object all_reduce_ptrs(host::HostComm& c, const std::vector<std::pair<uintptr_t, int64_t>>& ptrs, DType dtype,
                             RedOp op, int local_size, bool async_op, py::object keep) {
    std::vector<Piece> pieces;
    pieces.reserve(ptrs.size());
    for (const auto& [ptr, bytes] : ptrs) pieces.push_back({reinterpret_cast<char*>(ptr), bytes});
    return run(c, std::move(pieces), dtype, op, local_size, async_op, std::move(keep));
  }

  // all_gather_coalesced over resolved buffers: inputs [(pointer, bytes)] of `dtype`, outputs [pointer] of world
  // size times each input's bytes.
  py::object all_gather_ptrs(host::HostComm& c, const std::vector<std::pair<uintptr_t, int64_t>>& ins,
                             const std::vector<uintptr_t>& outs, DType dtype, int local_size, bool async_op,
                             py::object keep) {
    if (dtype_is_fp8(dtype)) GPUCOLL_THROW(ErrorCode::kUnsupported, "", "the host backend has no fp8 arithmetic");
    GPUCOLL_CHECK_ARG(ins.size() == outs.size(), "one output per input: got ", ins.size(), " inputs and ",
                      outs.size(), " outputs");
    std::vector<Piece> pieces;
    std::vector<char*> dsts;
    for (size_t i = 0; i < ins.size(); ++i) {
      if (ins[i].second == 0) continue;
      pieces.push_back({reinterpret_cast<char*>(ins[i].first), ins[i].second});
      dsts.push_back(reinterpret_cast<char*>(outs[i]));
    }
    const int64_t chunk = chunk_bytes_;
    return run_or_submit(c, "all_gather_coalesced", async_op, std::move(keep),
                         [&c, pieces = std::move(pieces), dsts = std::move(dsts), dtype, local_size,
                          chunk](std::vector<char>* staging) {
                           all_gather_pieces(c, pieces, dsts, dtype, local_size, chunk, staging);
                         });
  }

  int64_t chunk_bytes() const { return chunk_bytes_; }
  int64_t staging_bytes() const { return static_cast<int64_t>(staging_.size()); }

 private:
  py::object run(host::HostComm& c, std::vector<Piece> pieces, DType dtype, RedOp op, int local_size, bool async_op,
                 py::object keep) {
    if (dtype_is_fp8(dtype)) GPUCOLL_THROW(ErrorCode::kUnsupported, "", "the host backend has no fp8 arithmetic");
    pieces.erase(std::remove_if(pieces.begin(), pieces.end(), [](const Piece& p) { return p.bytes == 0; }),
                 pieces.end());
    const int64_t chunk = chunk_bytes_;
    return run_or_submit(c, "all_reduce_coalesced", async_op, std::move(keep),
                         [&c, pieces = std::move(pieces), dtype, op, local_size, chunk](std::vector<char>* staging) {
                           all_reduce_pieces(c, pieces, dtype, op, local_size, chunk, staging);
                         });
  }

  // Runs `body(staging)` now, without the GIL, on the shared staging buffer; for async_op, on the communicator's
  // progress thread with a staging buffer of its own, returning its Work at once (`keep` alive until it ran: a
  // tuple, not the caller's list, which may change meanwhile). A call mismatch says that the collectives it names
  // were a coalesced call's (every rank catches the same error alike, so the communicator stays as usable as the
  // call check leaves it).
  template <class Body>
  py::object run_or_submit(host::HostComm& c, const char* what, bool async_op, py::object keep, Body body) {
    auto checked = [what, body = std::move(body)](std::vector<char>* staging) {
      try {
        body(staging);
      } catch (const host::CallMismatch& e) {
        throw host::CallMismatch(std::string("in ") + what + " (its arrays packed into one collective per chunk, "
                                     "of the total size of the arrays): " + e.message(),
                                 e.call().c_str(), e.ranks(), __FILE__, __LINE__);
      }
    };
    if (async_op) {
      std::shared_ptr<Completion> done;
      {
        py::gil_scoped_release nogil;
        done = c.submit([checked = std::move(checked)]() {
          std::vector<char> own;
          checked(&own);
        });
      }
      return py::cast(std::make_shared<Work>(std::move(done), py::tuple(std::move(keep))));
    }
    py::gil_scoped_release nogil;
    std::lock_guard<std::mutex> lock(mu_);
    checked(&staging_);
    return py::none();
  }

  const int64_t chunk_bytes_;
  std::mutex mu_;  // over staging_: two threads' synchronous calls on one communicator must not share it at once
  std::vector<char> staging_;
};

}  // namespace

void bind_host_coalesced(py::module_& m) {
  py::class_<HostCoalescer>(m, "HostCoalescer")
      .def(py::init<int64_t>(), py::arg("chunk_bytes"))
      .def("all_reduce", &HostCoalescer::all_reduce, py::arg("comm"), py::arg("arrays"), py::arg("op"),
           py::arg("local_size"), py::arg("async_op") = false,
           "all_reduce of every array of `arrays` (NumPy arrays, CPU torch tensors) in place, in one call; returns "
           "None (or a Work for async_op), or the index of the first array it cannot read or whose dtype differs "
           "from the first's, having run nothing.")
      .def("all_reduce_ptrs", &HostCoalescer::all_reduce_ptrs, py::arg("comm"), py::arg("ptrs"), py::arg("dtype"),
           py::arg("op"), py::arg("local_size"), py::arg("async_op"), py::arg("keep"),
           "The same over resolved buffers: [(pointer, bytes)] of `dtype`; `keep` stays alive until it ran.")
      .def("all_gather_ptrs", &HostCoalescer::all_gather_ptrs, py::arg("comm"), py::arg("inputs"),
           py::arg("outputs"), py::arg("dtype"), py::arg("local_size"), py::arg("async_op"), py::arg("keep"),
           "all_gather of every input into its output (world size times its rows), in one call.")
      .def_property_readonly("chunk_bytes", &HostCoalescer::chunk_bytes)
      .def_property_readonly("staging_bytes", &HostCoalescer::staging_bytes,
                             "What the shared staging buffer holds now (at most chunk_bytes).");
}

}  // namespace gpucoll::python
