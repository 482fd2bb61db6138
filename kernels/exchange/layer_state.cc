#include "kernels/exchange/layer_state.h"

namespace geofp8 {

void LayerState::ResetGeometry() {
  active = Geometry{};
  pending = Geometry{};
  pending_from = 0;
  has_pending = false;
  active_digest = 0;
  sketch = FactorSketch{};
  products = InverseProducts{};
}

LayerState& LayerStateTable::at(uint32_t layer_id) {
  std::unique_ptr<LayerState>& s = states_[layer_id];
  if (!s) s = std::make_unique<LayerState>();
  return *s;
}

const LayerState* LayerStateTable::find(uint32_t layer_id) const {
  auto it = states_.find(layer_id);
  return it == states_.end() ? nullptr : it->second.get();
}

void LayerStateTable::DropResiduals() {
  for (auto& [id, s] : states_) {
    s->residual = LayerResidual{};
    s->next_residual = LayerResidual{};
  }
}

}  // namespace geofp8
