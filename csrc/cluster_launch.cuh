// Host side of launching a kernel, in thread-block clusters or not, on PyTorch's current stream: one
// place for the launch attributes that the wgmma GEMM, the decode GEMVs and the sparse kernel share.
#pragma once

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <map>
#include <mutex>
#include <tuple>
#include <utility>

namespace twell {

constexpr int kPortableClusterMax = 8;   // what every sm_90 part schedules
constexpr int kNonPortableClusterMax = 16;  // H100 / H200, with the kernel's opt-in

// The current device's opt-in limit of dynamic shared memory per block (232,448 bytes on an H100 or
// H200): what the size checks of the kernels whose shared memory grows with F compare against.
inline size_t current_device_optin_smem() {
  int device = 0, max_smem = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&max_smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  return static_cast<size_t>(max_smem);
}

// Whether the launches made on this thread carry the programmatic-stream-serialization attribute
// (programmatic dependent launch): a kernel may then be scheduled before the previous kernel in the
// stream has finished, and waits for it on the device (the first thing each kernel launched here does:
// ptx::wait_for_predecessor_then_release_successor). That hides most of each launch's latency between
// the short kernels of a decode-sized call. Off unless a ProgrammaticLaunchScope says otherwise.
inline bool& programmatic_launches() {
  thread_local bool enabled = false;
  return enabled;
}

// Programmatic launches on (or off) for the launches made on this thread while it lives.
class ProgrammaticLaunchScope {
 public:
  explicit ProgrammaticLaunchScope(bool enabled) : saved_(programmatic_launches()) { programmatic_launches() = enabled; }
  ~ProgrammaticLaunchScope() { programmatic_launches() = saved_; }
  ProgrammaticLaunchScope(const ProgrammaticLaunchScope&) = delete;
  ProgrammaticLaunchScope& operator=(const ProgrammaticLaunchScope&) = delete;

 private:
  bool saved_;
};

// One launch of `grid` CTAs of `threads` threads, in clusters of `cluster` CTAs along x (1: plain CTAs,
// no cluster attribute). Not copyable: the configuration points at the object's own attributes.
// The kernel must begin with ptx::wait_for_predecessor_then_release_successor (see programmatic_launches).
class KernelLaunch {
 public:
  template <typename... Params>
  KernelLaunch(void (*kernel)(Params...), dim3 grid, int threads, size_t smem, int cluster)
      : kernel_(reinterpret_cast<const void*>(kernel)) {
    TORCH_CHECK(cluster >= 1 && cluster <= kNonPortableClusterMax, "twell: cluster size ", cluster, " out of range");
    TORCH_CHECK(grid.x % static_cast<unsigned>(cluster) == 0, "twell: grid not a whole number of clusters");
    if (smem > 48 * 1024) {
      set_attribute_once(kernel_, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
    }
    if (cluster > kPortableClusterMax) {
      set_attribute_once(kernel_, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
    }
    unsigned count = 0;
    if (cluster > 1) {
      cudaLaunchAttribute& clustered = attributes_[count++];
      clustered.id = cudaLaunchAttributeClusterDimension;
      clustered.val.clusterDim.x = static_cast<unsigned>(cluster);
      clustered.val.clusterDim.y = 1;
      clustered.val.clusterDim.z = 1;
    }
    cluster_attrs_ = count;
    if (programmatic_launches()) {
      cudaLaunchAttribute& programmatic = attributes_[count++];
      programmatic.id = cudaLaunchAttributeProgrammaticStreamSerialization;
      programmatic.val.programmaticStreamSerializationAllowed = 1;
    }
    config_.gridDim = grid;
    config_.blockDim = dim3(static_cast<unsigned>(threads));
    config_.dynamicSmemBytes = smem;
    config_.stream = c10::cuda::getCurrentCUDAStream();
    config_.attrs = attributes_;
    config_.numAttrs = count;
  }
  KernelLaunch(const KernelLaunch&) = delete;
  KernelLaunch& operator=(const KernelLaunch&) = delete;

  void set_grid_x(unsigned x) { config_.gridDim.x = x; }

  // How many of this launch's clusters can be resident at once on the current device (0: none fits).
  // A host query, made once per device and kernel and launch shape, kept off the hot path.
  int resident_clusters() const {
    int device = 0;
    C10_CUDA_CHECK(cudaGetDevice(&device));
    const Key key{device, kernel_, config_.blockDim.x, config_.dynamicSmemBytes,
                  cluster_attrs_ ? attributes_[0].val.clusterDim.x : 1u};
    static std::mutex mutex;
    static std::map<Key, int> known;
    {
      const std::lock_guard<std::mutex> lock(mutex);
      const auto it = known.find(key);
      if (it != known.end()) return it->second;
    }
    int clusters = 0;
    cudaLaunchConfig_t shape = config_;  // the occupancy query takes the cluster attribute only
    shape.numAttrs = cluster_attrs_;
    const cudaError_t status = cudaOccupancyMaxActiveClusters(&clusters, kernel_, &shape);
    if (status != cudaSuccess) {
      (void)cudaGetLastError();  // an unschedulable shape reports an error here; it means none fits
      clusters = 0;
    }
    const std::lock_guard<std::mutex> lock(mutex);
    known[key] = clusters;
    return clusters;
  }

  // Function attributes belong to the current device's context: set once per device, kernel and value
  // (a host call each launch is time a decode-sized call cannot spare). Both attributes used here are
  // upper bounds (dynamic shared memory, cluster size allowed), so the largest value asked for so far
  // is kept: setting a smaller one after a larger would fail the launches that need the larger.
  static void set_attribute_once(const void* kernel, cudaFuncAttribute attribute, int value) {
    int device = 0;
    C10_CUDA_CHECK(cudaGetDevice(&device));
    const std::tuple<int, const void*, int> key{device, kernel, static_cast<int>(attribute)};
    static std::mutex mutex;
    static std::map<std::tuple<int, const void*, int>, int> set;
    const std::lock_guard<std::mutex> lock(mutex);
    const auto it = set.find(key);
    if (it != set.end() && it->second >= value) return;
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, attribute, value));
    set[key] = value;
  }

  template <typename... Params, typename... Args>
  void run(void (*kernel)(Params...), Args&&... args) const {
    TORCH_CHECK(reinterpret_cast<const void*>(kernel) == kernel_, "twell: internal error, launch of another kernel");
    C10_CUDA_CHECK(cudaLaunchKernelEx(&config_, kernel, std::forward<Args>(args)...));
  }

 private:
  struct Key {
    int device;
    const void* kernel;
    unsigned threads;
    size_t smem;
    unsigned cluster;
    bool operator<(const Key& o) const {
      return std::tie(device, kernel, threads, smem, cluster) < std::tie(o.device, o.kernel, o.threads, o.smem, o.cluster);
    }
  };
  const void* kernel_;
  cudaLaunchAttribute attributes_[2]{};  // the cluster shape (if clustered), then the programmatic launch (if on)
  unsigned cluster_attrs_ = 0;
  cudaLaunchConfig_t config_{};
};

}  // namespace twell
