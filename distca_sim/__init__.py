"""distca_sim: the cluster step-time simulator. Pure Python + numpy on top of :mod:`scheduler`.

Does core attention disaggregation pay off on a cluster? :func:`distca_sim.simulate.simulate`
models one training step (distca vs WLB-ideal, per-document CP and plain packing) on batches drawn
from the packaged document-length traces (:mod:`distca_sim.workloads`). Modules: ``simulate``
(the API), ``systems`` (the four systems), ``hardware`` (model, GPU presets, memory, kernel
rates), ``network`` (links and collectives), ``pipeline`` (1F1B and ping-pong schedules),
``profile`` (measured kernel latency tables), ``workloads`` (traces, sampling, packing), ``cli``
(``distca simulate``). Imports neither torch nor ray.
"""
