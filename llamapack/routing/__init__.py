"""Real expert routing: trace files (``trace``), per-expert counts (``counts``), the calibrated routing model
(``model``) and hit-rate replay through the cache policies (``hitrate``). Pure numpy: no libllama, no I/O beyond
reading and writing traces and counts (``plot`` draws the hit-rate figure; ``command`` is ``llamapack trace``)."""
from .counts import RoutingCounts, counts_from_trace, load_counts, save_counts
from .hitrate import POLICIES, HitRates, hit_rates
from .model import GRANITE_REUSE, ReuseProfile, RoutingModel, fit_reuse
from .trace import RoutingTrace, TraceError, load_trace, save_trace, trace_from_granite_json

__all__ = ["RoutingTrace", "TraceError", "load_trace", "save_trace", "trace_from_granite_json", "RoutingCounts",
           "counts_from_trace", "load_counts", "save_counts", "RoutingModel", "ReuseProfile", "GRANITE_REUSE",
           "fit_reuse", "POLICIES", "HitRates", "hit_rates"]
