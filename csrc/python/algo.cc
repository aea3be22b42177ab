#include <pybind11/stl.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <tuple>
#include <vector>

#include "check/call_mismatch.h"
#include "algo/checker.h"
#include "algo/registry.h"
#include "select/selector.h"
#include "core/error.h"
#include "python/bindings.h"

namespace py = pybind11;

namespace gpucoll::python {

namespace {
const algo::Algorithm& get_algorithm(const std::string& name) {
  const algo::Algorithm* a = algo::find_algorithm(name);
  if (a == nullptr) GPUCOLL_INVALID_ARG("unknown algorithm '", name, "'");
  return *a;
}

// local_size <= 0 means one node, as everywhere in the Python API.
algo::Params make_params(int coll, int nranks, int root, int local_size) {
  return algo::Params{static_cast<algo::Coll>(coll), nranks, root, local_size > 0 ? local_size : nranks};
}

// A schedule given as explicit tables (ops[rank][step]), so that tests can feed the checker schedules it must
// reject: a registry entry's function pointers cannot capture, so they read the table being checked from here.
struct TableSchedule {
  algo::Shape shape;
  std::vector<std::vector<std::vector<algo::Op>>> ops;
};
thread_local const TableSchedule* g_table = nullptr;

const algo::Algorithm& table_algorithm() {
  static const algo::Algorithm a = {
      "table", "explicit op tables (tests)", [](algo::Coll) { return true; },
      [](const algo::Params&) -> const char* { return nullptr; }, [](const algo::Params&) { return g_table->shape; },
      [](const algo::Params&, int32_t rank, int32_t step, algo::Op* out) {
        const auto& list = g_table->ops[static_cast<size_t>(rank)][static_cast<size_t>(step)];
        std::copy(list.begin(), list.end(), out);
        return static_cast<int>(list.size());
      }};
  return a;
}

py::dict check_result_dict(const algo::CheckResult& r) {
  py::dict d;
  d["ok"] = r.ok;
  d["error"] = r.error;
  d["nsteps"] = r.nsteps;
  d["nchunks"] = r.nchunks;
  d["bytes_sent"] = r.bytes_sent;
  d["bytes_recv"] = r.bytes_recv;
  d["active_steps"] = r.active_steps;
  return d;
}
}  // namespace

void bind_algo(py::module_& m) {
  m.def("algorithm_names", []() {
    std::vector<std::string> names;
    for (const algo::Algorithm* a : algo::algorithms()) names.emplace_back(a->name);
    return names;
  });
  m.def(
      "algorithm_supports",
      [](const std::string& name, int coll) { return get_algorithm(name).supports(static_cast<algo::Coll>(coll)); },
      py::arg("name"), py::arg("coll"));
  m.def(
      "check_schedule",
      [](const std::string& name, int coll, int nranks, int root, int local_size, int64_t nbytes) {
        const algo::Params p = make_params(coll, nranks, root, local_size);
        GPUCOLL_CHECK_ARG(nranks >= 1, "nranks must be >= 1, got ", nranks);
        GPUCOLL_CHECK_ARG(root >= 0 && root < nranks, "root must be in [0, ", nranks, "), got ", root);
        return check_result_dict(algo::check_schedule(get_algorithm(name), p, nbytes));
      },
      py::arg("algo"), py::arg("coll"), py::arg("nranks"), py::arg("root") = 0, py::arg("local_size") = 0,
      py::arg("nbytes") = 0);
  m.def(
      "check_schedule_table",
      [](int coll, int nranks, int root, int nchunks, const std::string& result,
         const std::vector<std::vector<std::vector<std::tuple<int, int, int, std::string, std::string>>>>& steps,
         int64_t nbytes) {
        GPUCOLL_CHECK_ARG(nranks >= 1 && static_cast<int>(steps.size()) == nranks, "steps needs one list per rank");
        GPUCOLL_CHECK_ARG(root >= 0 && root < nranks, "root must be in [0, ", nranks, "), got ", root);
        TableSchedule t;
        t.shape.nchunks = nchunks;
        t.shape.nsteps = static_cast<int32_t>(steps[0].size());
        t.shape.max_ops = 1;
        t.shape.result = result == "out" ? algo::Space::kOut : algo::Space::kWork;
        for (const auto& rank_steps : steps) {
          GPUCOLL_CHECK_ARG(static_cast<int32_t>(rank_steps.size()) == t.shape.nsteps, "every rank needs ",
                            t.shape.nsteps, " steps");
          auto& rank_ops = t.ops.emplace_back();
          for (const auto& step : rank_steps) {
            auto& list = rank_ops.emplace_back();
            for (const auto& [peer, src, dst, action, space] : step) {
              list.push_back(algo::Op{peer, src, dst, action == "reduce" ? algo::Action::kReduce : algo::Action::kCopy,
                                      space == "out" ? algo::Space::kOut : algo::Space::kWork});
            }
            t.shape.max_ops = std::max(t.shape.max_ops, static_cast<int32_t>(list.size()));
          }
        }
        struct Use {  // g_table points at `t` for this call only, also when the checker throws
          explicit Use(const TableSchedule* p) { g_table = p; }
          ~Use() { g_table = nullptr; }
        } use(&t);
        return check_result_dict(
            algo::check_schedule(table_algorithm(), make_params(coll, nranks, root, 0), nbytes));
      },
      py::arg("coll"), py::arg("nranks"), py::arg("root"), py::arg("nchunks"), py::arg("result"), py::arg("steps"),
      py::arg("nbytes") = 0,
      "Runs the checker on a schedule given as tables: steps[rank][step] = [(peer, src_chunk, dst_chunk, 'copy' or "
      "'reduce', 'work' or 'out'), ...], the form schedule_ops returns. For tests of the checker itself.");
  m.def(
      "schedule_ops",
      [](const std::string& name, int coll, int nranks, int root, int local_size, int rank) {
        const algo::Algorithm& a = get_algorithm(name);
        const algo::Params p = make_params(coll, nranks, root, local_size);
        GPUCOLL_CHECK_ARG(rank >= 0 && rank < nranks, "rank must be in [0, ", nranks, "), got ", rank);
        if (const char* why = a.unusable(p)) GPUCOLL_INVALID_ARG("algorithm '", name, "' cannot run: ", why);
        const algo::Shape shape = a.shape(p);
        std::vector<algo::Op> buf(static_cast<size_t>(std::max(shape.max_ops, 1)));
        py::list steps;
        for (int t = 0; t < shape.nsteps; ++t) {
          py::list ops;
          const int n = a.step_ops(p, rank, t, buf.data());
          for (int i = 0; i < n; ++i) {
            const algo::Op& op = buf[static_cast<size_t>(i)];
            ops.append(py::make_tuple(op.peer, op.src_chunk, op.dst_chunk,
                                      op.action == algo::Action::kCopy ? "copy" : "reduce",
                                      op.dst == algo::Space::kWork ? "work" : "out"));
          }
          steps.append(ops);
        }
        py::dict d;
        d["nchunks"] = shape.nchunks;
        d["result"] = shape.result == algo::Space::kWork ? "work" : "out";
        d["steps"] = steps;
        return d;
      },
      py::arg("algo"), py::arg("coll"), py::arg("nranks"), py::arg("root") = 0, py::arg("local_size") = 0,
      py::arg("rank") = 0);
  m.def(
      "algorithm_unusable",
      [](const std::string& name, int coll, int nranks, int root, int local_size) -> py::object {
        const algo::Algorithm& a = get_algorithm(name);
        if (!a.supports(static_cast<algo::Coll>(coll))) {
          return py::str(std::string(name) + " does not implement " + algo::coll_name(static_cast<algo::Coll>(coll)));
        }
        const algo::Params p = make_params(coll, nranks, root, local_size);
        const char* why = a.unusable(p);
        return why ? py::object(py::str(why)) : py::object(py::none());
      },
      py::arg("algo"), py::arg("coll"), py::arg("nranks"), py::arg("root") = 0, py::arg("local_size") = 0);
  m.def("algorithm_summary", [](const std::string& name) { return std::string(get_algorithm(name).summary); });
  m.def(
      "select_algorithm",
      [](int coll, int nranks, int64_t nbytes, int local_size, const std::string& requested) {
        return std::string(
            algo::select_algorithm(static_cast<algo::Coll>(coll), nranks, nbytes, local_size, requested).name);
      },
      py::arg("coll"), py::arg("nranks"), py::arg("nbytes"), py::arg("local_size") = 0, py::arg("requested") = "auto");
  m.def(
      "predict",
      [](const std::string& name, int coll, int nranks, int64_t nbytes, int local_size, double a_s, double b_s) {
        algo::CostParams cp = algo::host_cost_params();
        if (a_s > 0) cp.a_s = a_s;
        if (b_s > 0) cp.b_s_per_byte = b_s;
        const algo::Prediction p = algo::predict(get_algorithm(name), static_cast<algo::Coll>(coll), nranks, nbytes,
                                                 local_size, cp);
        py::dict d;
        d["usable"] = p.usable;
        d["reason"] = p.reason;
        d["seconds"] = p.seconds;
        d["steps"] = p.steps;
        d["pieces"] = p.pieces;
        d["bytes_sent"] = p.bytes_sent;
        d["bytes_recv"] = p.bytes_recv;
        return d;
      },
      py::arg("algo"), py::arg("coll"), py::arg("nranks"), py::arg("nbytes"), py::arg("local_size") = 0,
      py::arg("a") = 0.0, py::arg("b") = 0.0);
  m.def("cost_params", []() {
    const algo::CostParams cp = algo::host_cost_params();
    py::dict d;
    d["a"] = cp.a_s;
    d["b"] = cp.b_s_per_byte;
    d["segment_bytes"] = cp.segment_bytes;
    d["buffer_bytes"] = cp.buffer_bytes;
    d["cores"] = cp.cores;
    return d;
  });
  m.def("coll_names", []() {
    std::vector<std::string> names;
    for (int i = 0; i < algo::kNumColls; ++i) names.emplace_back(algo::coll_name(static_cast<algo::Coll>(i)));
    return names;
  });
  // The explicit call check of backends whose own synchronisation cannot carry a signature (NCCL, under
  // GPUCOLL_DEBUG_CHECKS): the same signature and the same message as the host backend's always-on check.
  m.def(
      "call_sig",
      [](uint32_t seq, int coll, int dtype, int op, bool premul, int root, int64_t count) {
        const algo::CallSig s = algo::make_call_sig(seq, coll < 0 ? algo::kSigBarrier : coll, dtype,
                                                    premul ? algo::kSigPremulSum : op, root, count, -1, 0, false);
        return py::bytes(reinterpret_cast<const char*>(&s), sizeof s);
      },
      py::arg("seq"), py::arg("coll"), py::arg("dtype"), py::arg("op"), py::arg("premul"), py::arg("root"),
      py::arg("count"), "A collective call's signature (csrc/check/call_sig.h) as bytes; coll < 0 is a barrier.");
  m.def(
      "call_mismatch",
      [](const std::vector<std::string>& sigs) -> py::object {
        std::vector<algo::CallSig> table(sigs.size());
        for (size_t r = 0; r < sigs.size(); ++r) {
          if (sigs[r].size() != sizeof(algo::CallSig)) {
            GPUCOLL_INVALID_ARG("call_mismatch: rank ", r, "'s signature has ", sigs[r].size(), " bytes, not ",
                                sizeof(algo::CallSig));
          }
          std::memcpy(&table[r], sigs[r].data(), sizeof(algo::CallSig));
        }
        const int n = static_cast<int>(table.size());
        if (n == 0 || algo::call_sigs_agree(table.data(), n)) return py::none();
        std::vector<int> odd;  // ranks whose call differs from rank 0's: the same list on every rank
        for (int q = 1; q < n; ++q) {
          if (!algo::call_sig_equal(table[0], table[static_cast<size_t>(q)])) odd.push_back(q);
        }
        return py::make_tuple(algo::call_mismatch_message(table.data(), n), odd);
      },
      py::arg("sigs"),
      "None when every rank's signature (call_sig) agrees, else (the message every rank raises, the ranks whose "
      "call differs from rank 0's).");
}

}  // namespace gpucoll::python
