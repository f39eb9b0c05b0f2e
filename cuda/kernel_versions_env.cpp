// kernel_versions_env.cpp: MHAR_KERNEL_VERSIONS, the kernel lab's numbered versions chosen for a
// whole process, so that a candidate default is timed in the real step (`mhar bench`,
// tools/bench_modes.sh) against the current one in one device call, without a rebuild. Format:
// comma-separated NAME=VERSION, e.g. MHAR_KERNEL_VERSIONS=key_grad=3,norm_backward=5; names below
// (cuda/routing_host.h names the routing file that says what each version does; norm.cu,
// classifier.cu and embedding.cu say theirs; side_stream, not a kernel, is where the
// backward's weight gradients run: cuda_backend.cu), VERSION 0 the default. Unset or empty:
// every default, which is what a run without the lab is. A bad name or version stops the backend's
// construction with the valid choices, and sets nothing.
#include <algorithm>
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

#include "cuda/kernels.h"
#include "engine/error.h"

namespace mhar::cuda {
namespace {

struct LabKernel {
  const char* name;
  int (*versions)();
  int (*set)(int);
};

template <RoutingKernel K>
LabKernel routing(const char* name) {
  return {name, [] { return routing_kernel_versions(K); },
          [](int v) { return routing_set_kernel_version(K, v); }};
}
template <NormKernel K>
LabKernel norm(const char* name) {
  return {name, [] { return norm_kernel_versions(K); },
          [](int v) { return norm_set_kernel_version(K, v); }};
}

std::vector<LabKernel> lab_kernels() {
  return {routing<RoutingKernel::MixTile>("mix_tile"),
          routing<RoutingKernel::TilePlan>("tile_plan"),
          routing<RoutingKernel::BackwardPair>("backward_pair"),
          routing<RoutingKernel::DeltaSite>("delta_site"),
          routing<RoutingKernel::DeltaForward>("delta_forward"),
          routing<RoutingKernel::Logits>("logits"),
          routing<RoutingKernel::MixFinish>("mix_finish"),
          routing<RoutingKernel::SourceValue>("source_value"),
          routing<RoutingKernel::KeyGrad>("key_grad"),
          routing<RoutingKernel::MixNorm>("mix_norm"),
          routing<RoutingKernel::QgTables>("qg_tables"),
          routing<RoutingKernel::SourceFinish>("source_finish"),
          norm<NormKernel::Forward>("norm_forward"),
          norm<NormKernel::Backward>("norm_backward"),
          norm<NormKernel::QkNormRope>("qk_norm_rope"),
          {"cross_entropy", cross_entropy_versions, cross_entropy_set_version},
          {"embedding_backward", embedding_backward_versions, embedding_backward_set_version},
          {"side_stream", side_stream_versions, side_stream_set_version}};
}

}  // namespace

void apply_kernel_versions_from_env() {
  const char* env = std::getenv("MHAR_KERNEL_VERSIONS");
  if (!env || !*env) return;
  const std::vector<LabKernel> kernels = lab_kernels();
  std::string names;
  for (const LabKernel& k : kernels) names += std::string(names.empty() ? "" : ", ") + k.name;
  const std::string all = env;
  std::vector<std::pair<const LabKernel*, int>> chosen;  // applied once all parse
  size_t begin = 0;
  while (begin <= all.size()) {
    const size_t end = std::min(all.find(',', begin), all.size());
    const std::string item = all.substr(begin, end - begin);
    begin = end + 1;
    if (item.empty()) continue;
    const size_t eq = item.find('=');
    const std::string name = item.substr(0, eq);
    const LabKernel* kernel = nullptr;
    for (const LabKernel& k : kernels)
      if (name == k.name) kernel = &k;
    if (eq == std::string::npos || !kernel)
      fail("MHAR_KERNEL_VERSIONS: '", item, "' is not NAME=VERSION with NAME one of ", names);
    const std::string value = item.substr(eq + 1);
    char* rest = nullptr;
    const long version = std::strtol(value.c_str(), &rest, 10);
    if (value.empty() || *rest || version < 0 || version > kernel->versions())
      fail("MHAR_KERNEL_VERSIONS: ", name, "=", value, " is not a version of ", name,
           " (0 for the default, or 1 .. ", kernel->versions(), ")");
    chosen.emplace_back(kernel, int(version));
  }
  for (const auto& [kernel, version] : chosen) kernel->set(version);
}

}  // namespace mhar::cuda
