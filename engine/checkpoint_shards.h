// checkpoint_shards.h: the ZeRO-1 parts of a checkpoint write (issue 16): each rank's
// AdamW moments in its own file, and the fp32 weights gathered from the shards for rank
// 0's model.safetensors. Loading a shard (from a checkpoint written by any number of
// ranks) is load_optimizer_moments in checkpoint.h, beside the other checked loads.
//
// optimizer.rank<R>.safetensors holds, for every parameter that rank R's shard touches,
// "<name>.exp_avg" and "<name>.exp_avg_sq" (F32, 1-D: the shard's elements of the
// flattened parameter) and, in the metadata, "world_size", "rank" and "range.<name>" =
// "<first element> <count>". A file without range metadata (written before data
// parallelism) holds whole parameters. Loading takes, for each element of this rank's
// shard, the value from whichever file holds it: the same world size reads its own file
// and is bit-exact; another world size reads every file (re-sharding).
#pragma once
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "engine/communicator.h"
#include "engine/model.h"
#include "engine/optimizer.h"

namespace mhar {

// The file name of rank `rank`'s optimizer shard.
std::string optimizer_shard_file(int rank);

// Writes this rank's optimizer shard into `dir` (checked writes; counts toward the
// simulated full disk) and returns its record {"bytes", "fnv1a64"} for state.json.
nlohmann::json write_optimizer_shard(const std::string& dir, const Model& model,
                                     const AdamWOptimizer& opt);

// The fp32 weights of every parameter (index-aligned with model.parameters(), each
// flattened), assembled on rank 0 from every rank's shard of the master copy (or of the
// parameters when they are the master). Other ranks get an empty vector. Collective.
std::vector<std::vector<float>> gather_fp32_weights(const Model& model, const AdamWOptimizer& opt,
                                                    Communicator& comm);

}  // namespace mhar
