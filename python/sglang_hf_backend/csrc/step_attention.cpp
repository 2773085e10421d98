// The attention node of a compiled step (attention.py's `attend` op), answered in C++ in decode.
//
// A compiled step calls its attention op once per layer. In Python that call (the layer's
// lookup, the batch's, the heads' views, the KV write and the kernel call) cost ~100 us a layer
// inside a step, where the weights' streams keep evicting the interpreter's data. Per decode
// step the attention backend publishes here what those calls read (the step's KV slots, each
// request's cached rows, and each layer's pool buffers and settings); the node then writes the
// step's K/V into the pool and attends with the paged decode kernel, the same two ops the Python
// path calls. Anything else (prefill, a layer or dtype not published) goes to the Python op
// `sglang_hf_backend::attend`.

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <cstdint>
#include <vector>

namespace {

struct Layer {
  at::Tensor k_buffer, v_buffer;  // this layer's [slots, kv_heads, dim] pool buffers
  double scale = 1.0, softcap = 0.0;
  int64_t window = -1;            // SGLang's convention: -1 for none
};

struct DecodeStep {
  bool active = false;
  at::Tensor loc, kv_index, kv_len;  // the step's KV slots, each request's cached slots and count
  std::vector<Layer> layers;         // by layer id (published ones have buffers)
};

DecodeStep& step() {
  static DecodeStep current;
  return current;
}

void begin_decode_step(const at::Tensor& loc, const at::Tensor& kv_index, const at::Tensor& kv_len,
                       at::IntArrayRef layer_ids, at::TensorList k_buffers, at::TensorList v_buffers,
                       c10::ArrayRef<double> scales, c10::ArrayRef<double> softcaps, at::IntArrayRef windows) {
  const size_t count = layer_ids.size();
  TORCH_CHECK(k_buffers.size() == count && v_buffers.size() == count && scales.size() == count &&
                  softcaps.size() == count && windows.size() == count,
              "begin_decode_step: one buffer pair and setting per layer");
  auto& current = step();
  current.layers.clear();
  for (size_t i = 0; i < count; ++i) {
    TORCH_CHECK(layer_ids[i] >= 0, "begin_decode_step: layer ids are >= 0");
    if (static_cast<size_t>(layer_ids[i]) >= current.layers.size()) current.layers.resize(layer_ids[i] + 1);
    current.layers[layer_ids[i]] = {k_buffers[i], v_buffers[i], scales[i], softcaps[i], windows[i]};
  }
  current.loc = loc;
  current.kv_index = kv_index;
  current.kv_len = kv_len;
  current.active = true;
}

void end_decode_step() { step() = DecodeStep(); }

// query [1, heads, tokens, dim], key/value [1, kv_heads, tokens, dim] (views), layer: its id as a
// tensor; returns [1, tokens, heads, v_dim].
at::Tensor attend(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, const at::Tensor& layer,
                  int64_t heads, int64_t v_dim) {
  const auto& current = step();
  const int64_t id = *layer.const_data_ptr<int64_t>();
  const Layer* published =
      current.active && id >= 0 && static_cast<size_t>(id) < current.layers.size() && current.layers[id].k_buffer.defined()
          ? &current.layers[id]
          : nullptr;
  if (published == nullptr || query.size(1) != heads || key.size(1) != published->k_buffer.size(1) ||
      key.scalar_type() != published->k_buffer.scalar_type() ||
      value.scalar_type() != published->v_buffer.scalar_type()) {
    static const auto python = c10::Dispatcher::singleton()
                                   .findSchemaOrThrow("sglang_hf_backend::attend", "")
                                   .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                     const at::Tensor&, int64_t, int64_t)>();
    return python.call(query, key, value, layer, heads, v_dim);
  }
  static const auto store = c10::Dispatcher::singleton()
                                .findSchemaOrThrow("sglang_hf_backend_kernels::store_kv", "")
                                .typed<void(at::Tensor&, at::Tensor&, const at::Tensor&, const at::Tensor&,
                                            const at::Tensor&)>();
  static const auto decode = c10::Dispatcher::singleton()
                                 .findSchemaOrThrow("sglang_hf_backend_kernels::paged_decode_attention", "")
                                 .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                   const at::Tensor&, const at::Tensor&, double, double, int64_t)>();
  at::Tensor k_buffer = published->k_buffer, v_buffer = published->v_buffer;
  store.call(k_buffer, v_buffer, current.loc, key[0].transpose(0, 1), value[0].transpose(0, 1));
  const auto out = decode.call(query[0].transpose(0, 1), k_buffer, v_buffer, current.kv_index, current.kv_len,
                               published->scale, published->softcap, published->window);
  return out.view({1, out.size(0), heads, v_dim});
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(sglang_hf_backend_kernels, m) {
  m.def(
      "begin_decode_step(Tensor loc, Tensor kv_index, Tensor kv_len, int[] layer_ids, Tensor[] k_buffers, "
      "Tensor[] v_buffers, float[] scales, float[] softcaps, int[] windows) -> ()");
  m.impl("begin_decode_step", c10::DispatchKey::CPU, &begin_decode_step);
  m.def("end_decode_step() -> ()", &end_decode_step);
  m.def("attend(Tensor query, Tensor key, Tensor value, Tensor layer, int heads, int v_dim) -> Tensor");
  m.impl("attend", c10::DispatchKey::CPU, &attend);
}
