// cai SDK: the index of fsdp's sharded checkpoint layout (docs/checkpoint-layout.md), which fsdp
// writes and reads and `cai export` reads to put full parameters back together.
//
// Meta "fsdp.index": "fsdp-sharded 1 <shards>", then per unit "unit <name> <s_u>" and one line
// per member "param <offset> <numel> <param name>" (offset into the unit's flat parameter).
// Shard j of a unit ("fsdp/<unit>/param.<j>", "fsdp/<unit>/state<k>.<j>") holds elements
// [j * s_u, (j + 1) * s_u) of its flat parameter or state slot.
#ifndef CAI_SDK_SHARDED_INDEX_HPP_
#define CAI_SDK_SHARDED_INDEX_HPP_

#include <cstdint>
#include <map>
#include <sstream>
#include <string>

#include "cai/sdk.hpp"

namespace cai::sdk {

// Where one parameter lies in the saved shards.
struct ShardedParam {
  std::string unit;
  int64_t offset = 0;  // into the saved unit's flat parameter
  int64_t numel = 0;
  int64_t shard = 0;  // the saved unit's shard size s_u
};

// "fsdp/<unit>/<what>.<j>": shard j of a unit's flat parameter ("param") or state ("state<k>").
inline std::string ShardedTensorName(const std::string& unit, const std::string& what, int64_t j) {
  return "fsdp/" + unit + "/" + what + "." + std::to_string(j);
}

// The parameters of an "fsdp.index" text, by name. Throws Error(DATA_LOSS) when malformed.
inline std::map<std::string, ShardedParam> ParseShardedIndex(const std::string& text) {
  std::istringstream in(text);
  std::string magic, word;
  int version = 0;
  int64_t shards = 0;
  if (!(in >> magic >> version >> shards) || magic != "fsdp-sharded" || version != 1) {
    throw Error(CAI_DATA_LOSS,
                "checkpoint meta 'fsdp.index' does not start with 'fsdp-sharded 1'; it was "
                "written by another version of fsdp");
  }
  std::map<std::string, ShardedParam> saved;
  std::string unit;
  int64_t shard = 0;
  while (in >> word) {
    if (word == "unit") {
      if (!(in >> unit >> shard) || shard <= 0) {
        throw Error(CAI_DATA_LOSS, "checkpoint meta 'fsdp.index' has a malformed unit line");
      }
    } else if (word == "param") {
      ShardedParam p{unit, 0, 0, shard};
      std::string name;
      if (unit.empty() || !(in >> p.offset >> p.numel) || p.offset < 0 || p.numel < 0) {
        throw Error(CAI_DATA_LOSS, "checkpoint meta 'fsdp.index' has a malformed param line");
      }
      in.get();
      std::getline(in, name);
      saved[name] = p;
    } else {
      throw Error(CAI_DATA_LOSS, "checkpoint meta 'fsdp.index' has an unknown line '" + word + "'");
    }
  }
  return saved;
}

}  // namespace cai::sdk

#endif  // CAI_SDK_SHARDED_INDEX_HPP_
