"""Expert parallelism (DeepEP's API): `buffer` is the front (`EPBuffer`, `EPHandle`), `normal` and
`low_latency` the methods of its two modes, `_routing` and `_staging` what they share.
`tridist.ops.moe` exports the ops."""
