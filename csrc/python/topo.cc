// Bindings of the topology value (csrc/topo/topology.h) and the topology-aware cost model (csrc/select/cost.h).
#include <pybind11/stl.h>

#include <algorithm>
#include <cmath>

#include "algo/registry.h"
#include "select/selector.h"
#include "core/error.h"
#include "python/bindings.h"
#include "select/cost.h"
#include "select/nccl_interval.h"
#include "select/nccl_model.h"
#include "topo/topology.h"

namespace py = pybind11;

namespace gpucoll::python {

namespace {

algo::Coll coll_arg(const std::string& name) {
  algo::Coll c;
  GPUCOLL_CHECK_ARG(algo::parse_coll(name, &c), "unknown collective '", name, "'");
  return c;
}

py::dict candidate_dict(const topo::Candidate& c) {
  py::dict d;
  d["backend"] = c.backend;
  d["algorithm"] = c.algorithm;
  d["protocol"] = c.protocol;
  d["link_class"] = c.link_class;
  d["usable"] = c.usable;
  d["reason"] = c.reason;
  d["steps"] = c.steps;
  d["bytes"] = c.bytes;
  d["seconds"] = c.seconds;
  d["busbw"] = c.busbw;
  d["model"] = c.model;
  d["tuner_seconds"] = c.tuner_seconds;
  d["nccl_auto"] = c.nccl_auto;
  d["confidence"] = c.confidence;
  // The interval (nccl_interval.h): time and busbw e^(+-spread) around the prediction; absent when none.
  if (c.spread > 0 && c.usable) {
    d["seconds_low"] = c.seconds * std::exp(-c.spread);
    d["seconds_high"] = c.seconds * std::exp(c.spread);
    d["busbw_low"] = c.busbw * std::exp(-c.spread);
    d["busbw_high"] = c.busbw * std::exp(c.spread);
    d["interval"] = c.spread_why;
  }
  return d;
}

// The keyword arguments topo_candidates and topo_select share after (topology, coll, nbytes, dtype).
struct CallArgs {
  int per_node = 0, nodes = 0;
  std::vector<int> gpus;  // a communicator's placement (rank r on gpus[r]); empty: make_layout's default
  topo::Backends avail;
  std::string tuning;
};

topo::Layout layout_arg(const topo::Topology& t, const CallArgs& a) {
  if (a.gpus.empty()) return topo::make_layout(t, a.per_node, a.nodes);
  return topo::make_layout(t, std::max(a.nodes, 1), a.per_node > 0 ? a.per_node : static_cast<int>(a.gpus.size()),
                           a.gpus);
}

CallArgs call_args(int per_node, int nodes, bool custom, bool nccl, bool host, const std::string& tuning,
                   const std::vector<int>& gpus, const py::dict& why, const std::vector<std::string>& custom_algorithms,
                   int nccl_version) {
  CallArgs a;
  a.avail.nccl_version = nccl_version;
  a.per_node = per_node;
  a.nodes = nodes;
  a.gpus = gpus;
  a.avail.custom = custom;
  a.avail.nccl = nccl;
  a.avail.host = host;
  a.avail.custom_algorithms = custom_algorithms;
  for (const auto& kv : why) {
    const std::string k = py::str(kv.first), v = py::str(kv.second);
    if (k == "custom") a.avail.custom_why = v;
    else if (k == "nccl") a.avail.nccl_why = v;
    else if (k == "host") a.avail.host_why = v;
    else GPUCOLL_INVALID_ARG("why: keys are custom, nccl and host; got '", k, "'");
  }
  a.tuning = tuning;
  return a;
}

topo::Tuning tuning_arg(const std::string& tuning_json) {
  return tuning_json.empty() ? topo::active_tuning() : topo::parse_tuning(tuning_json, "tuning");
}

}  // namespace

void bind_topo(py::module_& m) {
  py::class_<topo::Topology>(m, "Topology", "The machine's wiring (csrc/topo/topology.h); JSON round-trips exactly.")
      .def(py::init<>())
      .def("to_json", &topo::Topology::to_json)
      .def_static("from_json", &topo::Topology::from_json, py::arg("text"))
      .def_property_readonly("num_gpus", &topo::Topology::num_gpus)
      .def_property_readonly("num_hosts", [](const topo::Topology& t) { return static_cast<int>(t.hosts.size()); })
      .def_readonly("source", &topo::Topology::source)
      .def_readonly("notes", &topo::Topology::notes)
      .def("host_names", [](const topo::Topology& t) {
        std::vector<std::string> n;
        for (const auto& h : t.hosts) n.push_back(h.name);
        return n;
      })
      .def("host_gpus", &topo::Topology::host_gpus, py::arg("host"))
      .def("gpu_host", [](const topo::Topology& t, int g) { return t.gpus.at(static_cast<size_t>(g)).host; },
           py::arg("gpu"))
      .def("gpu_bus_id", [](const topo::Topology& t, int g) { return t.gpus.at(static_cast<size_t>(g)).bus_id; },
           py::arg("gpu"))
      .def("link_class", [](const topo::Topology& t, int a, int b) {
        return std::string(topo::link_class_name(t.link(a, b).cls));
      }, py::arg("a"), py::arg("b"))
      .def("link_label", [](const topo::Topology& t, int a, int b) {
        // nvidia-smi's cell text: X, NV<n>, PIX, ..., plus NET for pairs across hosts.
        const topo::Link& l = t.link(a, b);
        return l.cls == topo::LinkClass::kNVL ? "NV" + std::to_string(l.nvlinks) : std::string(topo::link_class_name(l.cls));
      }, py::arg("a"), py::arg("b"))
      .def("link_nvswitch", [](const topo::Topology& t, int a, int b) { return t.link(a, b).nvswitch; })
      .def("link_p2p", [](const topo::Topology& t, int a, int b) { return std::string(topo::p2p_name(t.link(a, b).p2p)); })
      .def("set_p2p", [](topo::Topology& t, int a, int b, const std::string& state) {
        topo::P2P p;
        GPUCOLL_CHECK_ARG(topo::parse_p2p(state, &p), "p2p state must be unknown, supported, unsupported or failed; got '",
                          state, "'");
        GPUCOLL_CHECK_ARG(a != b, "set_p2p needs two different GPUs");
        t.link(a, b).p2p = p;
      }, py::arg("a"), py::arg("b"), py::arg("state"))
      .def("set_gpu_model", &topo::set_gpu_model, py::arg("name"),
           "Name every GPU and re-derive compute capability, PCIe/NVLink generation and NVSwitch from the name.")
      .def("set_cpu_vendor", [](topo::Topology& t, const std::string& v) {
        GPUCOLL_CHECK_ARG(v.empty() || v == "intel" || v == "amd" || v == "arm", "cpu_vendor must be intel, amd, arm "
                          "or empty; got '", v, "'");
        for (auto& h : t.hosts) h.cpu_vendor = v;
      }, py::arg("vendor"))
      .def("set_nic_speed", [](topo::Topology& t, double gbps) {
        GPUCOLL_CHECK_ARG(gbps > 0, "NIC speed must be > 0 Gb/s, got ", gbps);
        for (auto& n : t.nics) n.speed_gbps = gbps;
      }, py::arg("gbps"), "Set every NIC's speed (Gb/s); nvidia-smi text carries none.")
      .def("set_nic_transport", [](topo::Topology& t, const std::string& tr) {
        GPUCOLL_CHECK_ARG(topo::valid_net_transport(tr), "NIC transport must be ib, efa, tcp or empty; got '", tr, "'");
        for (auto& n : t.nics) n.transport = tr;
      }, py::arg("transport"), "Set how NCCL reaches the network through every NIC: ib (verbs), efa or tcp.")
      .def("cpu_vendor", [](const topo::Topology& t, int host) { return t.hosts.at(static_cast<size_t>(host)).cpu_vendor; },
           py::arg("host") = 0)
      .def("gpu_name", [](const topo::Topology& t, int g) { return t.gpus.at(static_cast<size_t>(g)).name; })
      .def("pair_bandwidth", [](const topo::Topology& t, int a, int b) { return topo::pair_bandwidth(t, a, b); })
      .def("p2p_usable", [](const topo::Topology& t, int a, int b) -> py::object {
        std::string why;
        if (topo::p2p_usable(t, a, b, &why)) return py::none();
        return py::str(why);
      })
      .def("__eq__", [](const topo::Topology& a, const topo::Topology& b) { return a == b; })
      .def("__repr__", [](const topo::Topology& t) {
        return "<gpucoll.Topology " + std::to_string(t.num_gpus()) + " GPUs on " + std::to_string(t.hosts.size()) +
               " host(s), source=" + t.source + ">";
      });
  m.def("topo_detect", &topo::detect);
  m.def("topo_detect_local", &topo::detect_local);
  m.def("topo_from_nvidia_smi", &topo::from_nvidia_smi, py::arg("text"));
  m.def("topo_from_nccl_xml", &topo::from_nccl_xml, py::arg("text"));
  m.def("topo_from_text", &topo::from_text, py::arg("text"));
  m.def("topo_merge", &topo::merge, py::arg("parts"));
  m.def("topo_replicate", &topo::replicate, py::arg("topology"), py::arg("nodes"));
  m.def("topo_build_ring", &topo::build_ring, py::arg("topology"), py::arg("gpus"), py::arg("require_p2p") = false);
  m.def(
      "topo_layout",
      [](const topo::Topology& t, int per_node, int nodes) {
        const topo::Layout l = topo::make_layout(t, per_node, nodes);
        return py::make_tuple(l.nodes, l.local, l.gpus);
      },
      py::arg("topology"), py::arg("nranks_per_node") = 0, py::arg("nodes") = 0);
  // Shared keyword arguments: nranks_per_node, nodes (0: make_layout's defaults), gpus (explicit placement),
  // custom/nccl/host (availability), why (backend -> why it is unavailable), custom_algorithms, tuning (JSON
  // text; empty: GPUCOLL_TUNING_FILE).
  m.def(
      "topo_candidates",
      [](const topo::Topology& t, const std::string& coll, int64_t nbytes, const std::string& dtype, int per_node,
         int nodes, bool custom, bool nccl, bool host, const std::string& tuning, const std::vector<int>& gpus,
         const py::dict& why, const std::vector<std::string>& custom_algorithms, const std::string& host_algorithm,
         int nccl_version) {
        const CallArgs a =
            call_args(per_node, nodes, custom, nccl, host, tuning, gpus, why, custom_algorithms, nccl_version);
        py::list out;
        for (const auto& c : topo::candidates(t, layout_arg(t, a), coll_arg(coll), nbytes, dtype, a.avail,
                                              tuning_arg(a.tuning), host_algorithm)) {
          out.append(candidate_dict(c));
        }
        return out;
      },
      py::arg("topology"), py::arg("coll"), py::arg("nbytes"), py::arg("dtype") = "float32",
      py::arg("nranks_per_node") = 0, py::arg("nodes") = 0, py::arg("custom") = true, py::arg("nccl") = true,
      py::arg("host") = true, py::arg("tuning") = "", py::arg("gpus") = std::vector<int>{},
      py::arg("why") = py::dict(), py::arg("custom_algorithms") = std::vector<std::string>{},
      py::arg("host_algorithm") = "", py::arg("nccl_version") = 0);
  m.def(
      "topo_select",
      [](const topo::Topology& t, const std::string& coll, int64_t nbytes, const std::string& dtype, int per_node,
         int nodes, bool custom, bool nccl, bool host, const std::string& requested, const std::string& tuning,
         const std::vector<int>& gpus, const py::dict& why, const std::vector<std::string>& custom_algorithms,
         int nccl_version) {
        const CallArgs a =
            call_args(per_node, nodes, custom, nccl, host, tuning, gpus, why, custom_algorithms, nccl_version);
        return candidate_dict(
            topo::select(t, layout_arg(t, a), coll_arg(coll), nbytes, dtype, a.avail, requested, tuning_arg(a.tuning)));
      },
      py::arg("topology"), py::arg("coll"), py::arg("nbytes"), py::arg("dtype") = "float32",
      py::arg("nranks_per_node") = 0, py::arg("nodes") = 0, py::arg("custom") = true, py::arg("nccl") = true,
      py::arg("host") = true, py::arg("requested") = "auto", py::arg("tuning") = "",
      py::arg("gpus") = std::vector<int>{}, py::arg("why") = py::dict(),
      py::arg("custom_algorithms") = std::vector<std::string>{}, py::arg("nccl_version") = 0);
  m.def(
      "topo_model_terms",
      [](const std::string& backend, const std::string& algorithm, const std::string& coll, int nranks,
         int local) -> py::object {
        int steps = 0;
        double per_byte = 0;
        if (!topo::model_terms(backend, algorithm, coll_arg(coll), nranks, local, &steps, &per_byte)) return py::none();
        return py::make_tuple(steps, per_byte);
      },
      py::arg("backend"), py::arg("algorithm"), py::arg("coll"), py::arg("nranks"), py::arg("local") = 0);
  // GPUCOLL_ALGO's entry for one collective ("" when none), parsed by the host selector, its one reader.
  m.def("topo_algo_override", [](const std::string& coll) { return algo::algo_override(coll_arg(coll)); },
        py::arg("coll"));
  m.def("topo_nccl_params", [](const std::string& tuning) {
    py::dict d;
    for (const auto& kv : topo::nccl_param_values(tuning_arg(tuning))) d[py::str(kv.first)] = kv.second;
    return d;
  }, py::arg("tuning") = "");
  m.def(
      "topo_nccl_net_terms",
      [](const topo::Topology& t, const std::string& coll, int64_t nbytes, const std::string& dtype, int per_node,
         int nodes, const std::string& tuning, int nccl_version) {
        const topo::Layout lay = topo::make_layout(t, per_node, nodes);
        const topo::NetTerms r =
            topo::nccl_net_terms(t, lay, coll_arg(coll), static_cast<double>(nbytes), dtype, nccl_version,
                                 tuning_arg(tuning));
        py::dict d;
        d["algorithm"] = r.algorithm;
        d["protocol"] = r.protocol;
        d["base_s"] = r.base_s;
        d["net_steps"] = r.net_steps;
        d["net_s"] = r.net_s;
        return d;
      },
      py::arg("topology"), py::arg("coll"), py::arg("nbytes"), py::arg("dtype") = "float32",
      py::arg("nranks_per_node") = 0, py::arg("nodes") = 0, py::arg("tuning") = "", py::arg("nccl_version") = 0);
  m.def("topo_nccl_confidence", [](const topo::Topology& t, int per_node, int nodes) {
    return topo::nccl_confidence(t, topo::make_layout(t, per_node, nodes));
  }, py::arg("topology"), py::arg("nranks_per_node") = 0, py::arg("nodes") = 0);
  m.def("topo_nccl_path", [](const topo::Topology& t, int per_node, int nodes, const std::vector<int>& gpus) {
    CallArgs a;
    a.per_node = per_node;
    a.nodes = nodes;
    a.gpus = gpus;
    const topo::NcclPath p = topo::nccl_path(t, layout_arg(t, a));
    py::dict d;
    d["kind"] = p.kind;
    d["cc"] = p.cc;
    d["local"] = p.local;
    d["nodes"] = p.nodes;
    return d;
  }, py::arg("topology"), py::arg("nranks_per_node") = 0, py::arg("nodes") = 0, py::arg("gpus") = std::vector<int>{});
  m.def("topo_busbw_factor", [](const std::string& coll, int n) { return topo::busbw_factor(coll_arg(coll), n); });
  m.def("topo_check_tuning", [](const std::string& text) { return topo::parse_tuning(text, "tuning").fits.size(); });
}

}  // namespace gpucoll::python
