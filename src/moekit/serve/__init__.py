"""Serving a run to many clients: the OpenAI API (``app``, ``protocol``, ``responses``, ``chat``), the
continuous-batching ``engine`` and its pure ``scheduler``, the paged KV cache (``kv``), ``metrics``, and
the process around them (``server``). ``moekit.infer.generate`` stays the offline path."""
