// Leases: the twell ops' repeat calls served in C++, with no Python beyond the op's kernel frame.
//
// At decode sizes without CUDA graphs (torch.compile's default mode, or eager) the host sets the pace,
// and the op's Python (its checks, the per-shape plan, the density router, the weight caches; about
// 40 us a call on an H200's host) cost more than Inductor's whole dense MLP (examples/results/
// README.md, "Decoding without CUDA graphs"). Yet a layer's calls of one size repeat the same choices.
// So after a call has taken the Python path (twell_compile/kernels/twell_mlp.py), Python may grant its
// layer a lease: the call's plan, its route (TwELL or cuBLAS), the derived weight it used (W_down^T)
// and how many more calls may take them without asking (the density router's next report is due; no
// limit where it does not watch the size; the calls served are counted for it). fast_mlp serves a call from its layer's lease when every
// operand is the one the lease was granted for (same data, sizes, strides, dtype and device; the
// weights' storages alive, W_down's version unchanged) and the call is on the granting stream, not
// under capture; anything else returns None and the call takes the Python path, which checks and
// raises as always. That call ends the layer's lease first (end_lease), taking its count of served
// calls, and may grant a new one: a lease never outlives a call it did not serve, which the router
// counted and which may have changed the layer's route. Python also revokes leases whenever what they
// were derived from may change: the settings, the router's state, the weight caches.
// A lease that finds W_down changed is spent, not erased: it serves no more calls and lets its W_down^T
// go, but keeps its count of served calls for end_lease. A call mlp_forward declines is not counted as
// served: the Python path takes it and ends the lease.
//
// A lease is keyed by its activated projection's weight (the gate's, or the up projection's when not
// gated), as the router keys its layers: the storage's data pointer, with a weak reference to the
// storage so that a freed weight whose address is reused never matches.

#include <ATen/ATen.h>
#include <c10/core/StorageImpl.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/intrusive_ptr.h>

#include <array>
#include <cstdint>
#include <mutex>
#include <optional>
#include <unordered_map>

#include "twell_entries.h"

namespace twell {
namespace {

constexpr size_t kMaxLeases = 4096;  // one per layer: past it (many models alive at once) start over

// What a lease needs unchanged in an operand: its data, sizes and strides (dtype and device are the
// call's, checked once on x). A weight also keeps a weak reference to its storage.
struct OperandSignature {
  bool present = false;
  const void* data = nullptr;
  int64_t dim = 0;
  std::array<int64_t, 2> sizes{}, strides{};

  static OperandSignature of(const c10::optional<at::Tensor>& t) {
    OperandSignature s;
    if (!t.has_value() || !t->defined()) return s;
    s.present = true;
    s.data = t->data_ptr();
    s.dim = t->dim();
    for (int64_t i = 0; i < s.dim && i < 2; ++i) {
      s.sizes[i] = t->size(i);
      s.strides[i] = t->stride(i);
    }
    return s;
  }

  bool matches(const c10::optional<at::Tensor>& t) const {
    if (!t.has_value() || !t->defined()) return !present;
    if (!present || t->data_ptr() != data || t->dim() != dim) return false;
    for (int64_t i = 0; i < dim; ++i) {
      if (t->size(i) != sizes[i] || t->stride(i) != strides[i]) return false;
    }
    return true;
  }
};

using StorageRef = c10::weak_intrusive_ptr<c10::StorageImpl>;

StorageRef storage_ref(const at::Tensor& t) { return StorageRef(t.storage().getWeakStorageImpl()); }

// Whether t's storage is the one `ref` was taken from (not only one at the same address: a storage can
// outlive its memory, resize_(0) as FSDP frees unsharded parameters, and another weight then get the
// address). The weak reference keeps that storage object allocated, so no other can take its place.
bool same_storage(const StorageRef& ref, const at::Tensor& t) {
  return ref._unsafe_get_target() == t.storage().unsafeGetStorageImpl();
}

struct Lease {
  std::optional<StorageRef> act_ref, up_ref, down_ref;
  OperandSignature act, act_bias, up, up_bias, down, down_bias;
  std::optional<c10::VariableVersion> down_counter;  // W_down's version counter (shared with the tensor)
  uint32_t down_version = 0;
  int64_t rows = 0, K = 0, D = 0;
  c10::ScalarType dtype = at::kBFloat16;
  c10::DeviceIndex device = 0;
  cudaStream_t stream = nullptr;
  bool cublas = false;  // the dense MLP through cuBLAS; else the TwELL path with `plan`
  MlpPlan plan;
  at::Tensor down_t;  // W_down^T, as the weight cache made it (the TwELL path)
  int64_t calls_left = 0;
  int64_t tag = -1;    // the caller's name for what counts the calls (the density router's size class)
  int64_t served = 0;  // calls served (end_lease hands the count to the caller)

  bool alive() const {
    return !act_ref->expired() && (!up_ref.has_value() || !up_ref->expired()) && !down_ref->expired();
  }
  // W_down changed in place since the grant (its W_down^T would be stale).
  bool stale() const { return down_counter->current_version() != down_version; }
  // Serves no more calls, and lets its W_down^T go; its served count stays for end_lease.
  void spend() {
    calls_left = 0;
    down_t = at::Tensor();
  }
};

std::mutex leases_mutex;
std::unordered_map<const void*, Lease> leases;  // by the activated weight's data pointer

bool is_capturing() {
  return c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None;
}

// The version counter of a tensor that has one (not an inference tensor).
uint32_t version_of(const at::Tensor& t) { return t.unsafeGetTensorImpl()->version_counter().current_version(); }

}  // namespace

bool grant_lease(const at::Tensor& x, const at::Tensor& w_act, const c10::optional<at::Tensor>& b_act,
                 const c10::optional<at::Tensor>& w_up, const c10::optional<at::Tensor>& b_up,
                 const at::Tensor& w_down, const c10::optional<at::Tensor>& b_down,
                 const c10::optional<MlpPlan>& plan, const c10::optional<at::Tensor>& w_down_t, int64_t calls,
                 int64_t tag) {
  TORCH_CHECK(x.is_cuda() && x.dim() >= 1 && x.size(-1) > 0, "twell: grant_lease takes the call's CUDA input");
  TORCH_CHECK(plan.has_value() == w_down_t.has_value(), "twell: a TwELL lease takes its plan and W_down^T");
  TORCH_CHECK(!plan.has_value() || !plan->chunked, "twell: chunked plans take sliced weights, which leases do not hold");
  if (calls <= 0 || is_capturing() || w_act.is_inference() || w_down.is_inference() ||
      (w_up.has_value() && w_up->is_inference()) || c10::cuda::current_device() != x.device().index()) {
    return false;
  }
  Lease lease;
  lease.act_ref = storage_ref(w_act);
  if (w_up.has_value()) lease.up_ref = storage_ref(*w_up);
  lease.down_ref = storage_ref(w_down);
  lease.act = OperandSignature::of(w_act);
  lease.act_bias = OperandSignature::of(b_act);
  lease.up = OperandSignature::of(w_up);
  lease.up_bias = OperandSignature::of(b_up);
  lease.down = OperandSignature::of(w_down);
  lease.down_bias = OperandSignature::of(b_down);
  lease.down_counter = w_down.unsafeGetTensorImpl()->version_counter();
  lease.down_version = lease.down_counter->current_version();
  lease.K = x.size(-1);
  lease.rows = x.numel() / lease.K;
  lease.D = w_down.size(0);
  lease.dtype = x.scalar_type();
  lease.device = x.device().index();
  lease.stream = c10::cuda::getCurrentCUDAStream(lease.device).stream();
  lease.cublas = !plan.has_value();
  if (plan.has_value()) {
    lease.plan = *plan;
    lease.down_t = *w_down_t;
  }
  lease.calls_left = calls;
  lease.tag = tag;
  const std::lock_guard<std::mutex> lock(leases_mutex);
  // A lease holds its W_down^T: those of layers whose weights are gone (a model deleted) are dropped at
  // every grant, as the weight caches drop theirs at every fill, so they do not outlive the next one;
  // those whose W_down changed in place (a training step) are spent, which lets the stale copy go.
  for (auto it = leases.begin(); it != leases.end();) {
    if (!it->second.alive()) {
      it = leases.erase(it);
      continue;
    }
    if (it->second.stale()) it->second.spend();
    ++it;
  }
  if (leases.size() >= kMaxLeases) leases.clear();
  leases.insert_or_assign(w_act.data_ptr(), std::move(lease));
  return true;
}

void revoke_lease(const at::Tensor& w_act) {
  const std::lock_guard<std::mutex> lock(leases_mutex);
  leases.erase(w_act.data_ptr());
}

void revoke_all_leases() {
  const std::lock_guard<std::mutex> lock(leases_mutex);
  leases.clear();
}

std::tuple<int64_t, int64_t> end_lease(const at::Tensor& w_act) {
  const std::lock_guard<std::mutex> lock(leases_mutex);
  const auto it = leases.find(w_act.data_ptr());
  if (it == leases.end()) return {-1, 0};
  const std::tuple<int64_t, int64_t> count{it->second.tag, it->second.served};
  leases.erase(it);
  return count;
}

int64_t lease_calls_left(const at::Tensor& w_act) {
  const std::lock_guard<std::mutex> lock(leases_mutex);
  const auto it = leases.find(w_act.data_ptr());
  return it == leases.end() ? -1 : it->second.calls_left;
}

c10::optional<at::Tensor> fast_mlp(const at::Tensor& x, const at::Tensor& w_act, const c10::optional<at::Tensor>& b_act,
                                   const c10::optional<at::Tensor>& w_up, const c10::optional<at::Tensor>& b_up,
                                   const at::Tensor& w_down, const c10::optional<at::Tensor>& b_down) {
  if (!x.defined() || !w_act.defined() || !w_down.defined() || x.dim() < 1 || !x.is_cuda()) return c10::nullopt;
  bool cublas;
  MlpPlan plan;
  at::Tensor down_t;
  int64_t rows, K, D;
  {
    const std::lock_guard<std::mutex> lock(leases_mutex);
    const auto it = leases.find(w_act.data_ptr());
    if (it == leases.end()) return c10::nullopt;
    Lease& lease = it->second;
    if (lease.calls_left <= 0 || x.scalar_type() != lease.dtype || x.device().index() != lease.device ||
        x.size(-1) != lease.K || x.numel() != lease.rows * lease.K) {
      return c10::nullopt;
    }
    if (!lease.act.matches(w_act) || !lease.act_bias.matches(b_act) || !lease.up.matches(w_up) ||
        !lease.up_bias.matches(b_up) || !lease.down.matches(w_down) || !lease.down_bias.matches(b_down)) {
      return c10::nullopt;
    }
    if (!same_storage(*lease.act_ref, w_act) || !same_storage(*lease.down_ref, w_down) ||
        (w_up.has_value() && !same_storage(*lease.up_ref, *w_up))) {
      return c10::nullopt;
    }
    // Same data pointers, sizes and strides; the rest of a tensor's identity (dtype and device too,
    // where the caller mixes them) is checked here, as the op's own checks would.
    for (const c10::optional<at::Tensor>& t : {c10::optional<at::Tensor>(w_act), b_act, w_up, b_up,
                                               c10::optional<at::Tensor>(w_down), b_down}) {
      if (t.has_value() && t->defined() && (t->scalar_type() != lease.dtype || t->device() != x.device())) {
        return c10::nullopt;
      }
    }
    if (!lease.alive()) {
      leases.erase(it);
      return c10::nullopt;
    }
    if (w_down.is_inference() || version_of(w_down) != lease.down_version) {
      lease.spend();
      return c10::nullopt;
    }
    if (c10::cuda::current_device() != lease.device ||
        c10::cuda::getCurrentCUDAStream(lease.device).stream() != lease.stream || is_capturing()) {
      return c10::nullopt;
    }
    --lease.calls_left;
    ++lease.served;
    cublas = lease.cublas;
    plan = lease.plan;
    down_t = lease.down_t;
    rows = lease.rows;
    K = lease.K;
    D = lease.D;
  }
  const at::Tensor x2 = x.reshape({rows, K});
  at::Tensor out;
  if (cublas) {
    out = std::get<0>(cublas_mlp(x2, w_act, b_act, w_up, b_up, w_down, b_down));
  } else {
    auto result = mlp_forward(plan, x2, w_act, b_act, w_up, b_up, w_down, down_t, b_down, c10::nullopt, c10::nullopt);
    if (!result.has_value()) {  // declined this x (rows not 16-byte aligned): the Python path takes it,
      // counts it and ends the lease; so it is not counted as served (unless replaced meanwhile)
      const std::lock_guard<std::mutex> lock(leases_mutex);
      const auto it = leases.find(w_act.data_ptr());
      if (it != leases.end() && it->second.served > 0) --it->second.served;
      return c10::nullopt;
    }
    out = std::get<0>(*result);
  }
  at::DimVector shape(x.sizes());  // inline storage: no heap allocation for the usual 2-3 dims
  shape.back() = D;
  return out.view(shape);
}

}  // namespace twell
