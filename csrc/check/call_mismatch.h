// Host-side words for call signatures (call_sig.h): how a call is described, and the one message every rank
// raises when ranks made different calls. Built from the table of all ranks' signatures only, never from the
// rank that builds it, so every rank raises exactly the same text.
#pragma once

#include <cstdint>
#include <string>

#include "check/call_sig.h"

namespace gpucoll::algo {

// "all_reduce(count=7, dtype=float32, op=sum, algo=ring by auto)", "barrier()".
std::string describe_call(const CallSig& s);

// True when every signature equals the first.
bool call_sigs_agree(const CallSig* sigs, int nranks);

// "ranks made different calls as collective #5 (they differ in count): ...", one line per group of ranks with
// the same call ("rank 2: ...", "ranks 0-1, 3: ...").
std::string call_mismatch_message(const CallSig* sigs, int nranks);

}  // namespace gpucoll::algo
