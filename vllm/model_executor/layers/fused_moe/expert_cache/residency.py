"""Residency: which expert sits in which slot of one MoE layer (the cache's "block manager").

INTERFACE STUB - to be implemented. Contract (all tensors on the slots' device; no host sync):

class Residency:
    def __init__(self, num_experts: int, num_slots: int, policy: EvictionPolicy, device):
        slot_of_expert: [E] int64, -1 = not resident      (owner: this class)
        expert_of_slot: [N] int64, -1 = empty             (owner: this class)
        policy_state: dict of small tensors               (owner: this class, updated by policy)
        clock: int64 scalar tensor, +1 per plan() call
        counters (int64 tensors, cumulative): hits, misses, evictions  (scalars)

    def plan(self, needed: Tensor) -> LoadPlan:
        needed: [E] bool, the experts this wave must have resident; needed.sum() <= N is a
        precondition (the caller splits larger sets into waves).
        Marks needed experts resident: hits stay where they are, each miss gets a victim slot
        chosen among slots NOT holding a needed expert (empty slots first, then lowest
        policy.keep_score). Never evicts a needed expert. Updates maps, policy state, counters.
        Returns LoadPlan(slots [N] int64, experts [N] int64, valid [N] bool, num_loads scalar int64):
        entry i says "copy expert experts[i] into slot slots[i]" when valid[i]. Fixed shape [N].

    def remap(self, topk_ids: Tensor) -> Tensor:  [T, K] expert ids -> [T, K] slot ids (slot_of_expert gather)
