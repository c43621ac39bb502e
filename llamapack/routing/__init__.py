"""Real expert routing: trace files (``trace``), the calibrated routing model (``model``) and hit-rate replay
through the cache policies (``hitrate``). Pure numpy: no libllama, no I/O beyond reading and writing traces."""
from .trace import RoutingTrace, load_trace, save_trace, trace_from_granite_json

__all__ = ["RoutingTrace", "load_trace", "save_trace", "trace_from_granite_json"]
