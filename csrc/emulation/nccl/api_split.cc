// New communicators from an existing one: ncclCommSplit (collective over the parent, in the parent's mode, the child
// written to *newcomm when it is ready) and ncclCommShrink (NCCL >= 2.27: called by the ranks that stay only, the
// others excluded, renumbered in parent-rank order).
//
// Both are one job on the parent: the takers exchange their records over the parent's channels, make the child,
// then exchange the child's mailboxes and connect them. A split exchanges with every rank of the parent (an
// all-gather); a shrink with the ranks that stay only (a send and a receive per pair of them), since the excluded
// ones make no call. The stand-in takes NCCL_SHRINK_DEFAULT only (a parent with nothing in flight): it has no way to
// cancel a parent's operations that wait for an excluded rank, which NCCL_SHRINK_ABORT asks for.
#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include <gpucoll_emu/api.h>

#include "nccl_emu.h"

namespace ncclemu {

using namespace gpucoll;  // NCCL's enum values (nccl_api.h)

namespace {

// Every taker's `mine` into all[rank]: over the whole parent (`takers` empty), else between the takers only.
ncclResult_t exchange(Comm& p, const std::vector<int>& takers, RankInfo* mine, std::vector<RankInfo>* all,
                      std::string* error) {
  std::vector<Task> tasks;
  if (takers.empty()) {
    Task t;
    t.coll = Coll::kAllGather;
    t.send = mine;
    t.recv = all->data();
    t.count = sizeof(RankInfo);
    t.type = ncclUint8;
    tasks.push_back(t);
  } else {
    (*all)[static_cast<size_t>(p.rank)] = *mine;
    for (int q : takers) {
      if (q == p.rank) continue;
      Task send;
      send.coll = Coll::kSend;
      send.send = mine;
      send.count = sizeof(RankInfo);
      send.type = ncclUint8;
      send.root = q;
      Task recv = send;
      recv.coll = Coll::kRecv;
      recv.send = nullptr;
      recv.recv = &(*all)[static_cast<size_t>(q)];
      tasks.push_back(send);
      tasks.push_back(recv);
    }
    if (tasks.empty()) return ncclSuccess;
  }
  // NCCL's bootstrap goes over sockets; this one moves the records through the mailboxes in device memory, from
  // this job's thread rather than a stream: it tells the emulator so, as device work would (region.cc).
  gpucoll_emu_agent_begin();
  const ncclResult_t r = execute(p, tasks, error);
  gpucoll_emu_agent_end();
  return r;
}

// The parent's part of a split or shrink. `takers`: the parent ranks that call (empty: all of them, a split).
ncclResult_t split_job(const std::shared_ptr<Comm>& parent, uint64_t ticket, const std::vector<int>& takers, int color,
                       int key, int child_blocking, ncclComm_t* newcomm, const char* call, std::string* error_out) {
  Comm& p = *parent;
  DeviceScope scope(p.device);
  ++p.running;
  std::string error;
  ncclResult_t r = ncclSuccess;
  std::shared_ptr<Comm> child;
  if (wait_turn(p, ticket)) {
    std::lock_guard<std::mutex> exec(p.exec_mu);
    RankInfo mine = my_info(p);
    mine.color = color;
    mine.key = key;
    std::vector<RankInfo> all(static_cast<size_t>(p.nranks));
    r = exchange(p, takers, &mine, &all, &error);
    std::vector<int> members;  // parent ranks of my child, in child rank order
    if (r == ncclSuccess && color != kNcclSplitNoColor) {
      for (int q = 0; q < p.nranks; ++q) {
        const bool took = takers.empty() || std::find(takers.begin(), takers.end(), q) != takers.end();
        if (took && all[static_cast<size_t>(q)].color == color) members.push_back(q);
      }
      std::stable_sort(members.begin(), members.end(), [&](int a, int b) { return all[a].key < all[b].key; });
      const int me = static_cast<int>(std::find(members.begin(), members.end(), p.rank) - members.begin());
      child = new_comm(me, static_cast<int>(members.size()), p.device, child_blocking);
      RankInfo cm = my_info(*child);
      r = transport_alloc(*child, &cm, &error);
      cm.color = color;
      mine = cm;
    }
    std::vector<RankInfo> handles(static_cast<size_t>(p.nranks));
    if (r == ncclSuccess) r = exchange(p, takers, &mine, &handles, &error);
    if (r == ncclSuccess && child) {
      std::vector<RankInfo> table;
      for (int m : members) table.push_back(handles[static_cast<size_t>(m)]);
      r = transport_connect(*child, table, &error);
      if (r == ncclSuccess) r = finish_setup(*child, &error);
    }
  }
  finish_turn(p, ticket);
  --p.running;
  if (p.aborted.load()) {
    if (child) release(*child);
    *error_out = "the parent communicator was aborted";
    return ncclInvalidUsage;
  }
  if (r == ncclSuccess && child) {
    auto* h = new gpucoll::ncclComm();
    h->comm = child;
    __atomic_store_n(newcomm, h, __ATOMIC_RELEASE);  // NCCL writes the child when the split is done
  } else if (child) {
    release(*child);
  }
  if (r != ncclSuccess) *error_out = std::string(call) + " on rank " + std::to_string(p.rank) + ": " + error;
  return r;
}

// Runs the job in the parent's mode: at once for a blocking parent, else on its job thread (ncclInProgress).
ncclResult_t run_split(Comm* pc, ncclComm_t h, std::vector<int> takers, int color, int key, int child_blocking,
                       ncclComm_t* newcomm, const char* call) {
  std::shared_ptr<Comm> parent = h->comm;
  uint64_t ticket;
  {
    std::lock_guard<std::mutex> lock(parent->launch_mu);
    ticket = parent->next_ticket++;
  }
  if (parent->blocking) {
    std::string error;
    const ncclResult_t r = split_job(parent, ticket, takers, color, key, child_blocking, newcomm, call, &error);
    return r == ncclSuccess ? r : warn(r, error);
  }
  parent->async = ncclInProgress;
  start_job(*pc, [=] {
    std::string text;
    const ncclResult_t r = split_job(parent, ticket, takers, color, key, child_blocking, newcomm, call, &text);
    if (!parent->aborted.load()) set_async(*parent, r, text);
  });
  return ncclInProgress;
}

}  // namespace
}  // namespace ncclemu

using namespace ncclemu;

NCCLEMU_API ncclResult_t ncclCommSplit(ncclComm_t h, int color, int key, ncclComm_t* newcomm, ncclConfig_t* config) {
  ncclResult_t err;
  Comm* pc = checked(h, "ncclCommSplit", &err);
  if (pc == nullptr) return err;
  if (newcomm == nullptr) return warn(ncclInvalidArgument, "ncclCommSplit : newcomm argument is NULL");
  if (const ncclResult_t r = ensure_ready(*pc, "ncclCommSplit")) return r;
  *newcomm = nullptr;
  if (color < 0 && color != kNcclSplitNoColor) {
    return warn(ncclInvalidArgument, "ncclCommSplit : color must be >= 0 or NCCL_SPLIT_NOCOLOR; got " +
                                         std::to_string(color));
  }
  int child_blocking = pc->blocking ? 1 : 0;
  std::string error;
  if (!read_config(config, child_blocking, &child_blocking, &error)) {
    return warn(ncclInvalidArgument, "ncclCommSplit : " + error);
  }
  return run_split(pc, h, {}, color, key, child_blocking, newcomm, "ncclCommSplit");
}

NCCLEMU_API ncclResult_t ncclCommShrink(ncclComm_t h, int* excludeRanksList, int excludeRanksCount, ncclComm_t* newcomm,
                                        ncclConfig_t* config, int shrinkFlags) {
  ncclResult_t err;
  Comm* pc = checked(h, "ncclCommShrink", &err);
  if (pc == nullptr) return err;
  if (newcomm == nullptr) return warn(ncclInvalidArgument, "ncclCommShrink : newcomm argument is NULL");
  if (excludeRanksCount < 0 || (excludeRanksCount > 0 && excludeRanksList == nullptr)) {
    return warn(ncclInvalidArgument, "ncclCommShrink : excludeRanksList is NULL or excludeRanksCount is negative");
  }
  if (shrinkFlags != kNcclShrinkDefault) {
    return warn(ncclInvalidArgument, "ncclCommShrink : the NCCL stand-in takes NCCL_SHRINK_DEFAULT only (it cannot "
                                     "abort a parent's operations); got flags " + std::to_string(shrinkFlags));
  }
  if (const ncclResult_t r = ensure_ready(*pc, "ncclCommShrink")) return r;
  *newcomm = nullptr;
  std::vector<bool> excluded(static_cast<size_t>(pc->nranks), false);
  for (int i = 0; i < excludeRanksCount; ++i) {
    const int q = excludeRanksList[i];
    if (q < 0 || q >= pc->nranks) {
      return warn(ncclInvalidArgument, "ncclCommShrink : excluded rank " + std::to_string(q) + " is not in [0, " +
                                           std::to_string(pc->nranks) + ")");
    }
    excluded[static_cast<size_t>(q)] = true;
  }
  if (excluded[static_cast<size_t>(pc->rank)]) {
    return warn(ncclInvalidArgument, "ncclCommShrink : rank " + std::to_string(pc->rank) +
                                         " is in excludeRanksList: excluded ranks do not call ncclCommShrink");
  }
  std::vector<int> takers;
  for (int q = 0; q < pc->nranks; ++q) {
    if (!excluded[static_cast<size_t>(q)]) takers.push_back(q);
  }
  int child_blocking = pc->blocking ? 1 : 0;
  std::string error;
  if (!read_config(config, child_blocking, &child_blocking, &error)) {
    return warn(ncclInvalidArgument, "ncclCommShrink : " + error);
  }
  // Every taker in one color, ordered by parent rank: the ranks that stay, renumbered densely.
  return run_split(pc, h, takers, 0, pc->rank, child_blocking, newcomm, "ncclCommShrink");
}
