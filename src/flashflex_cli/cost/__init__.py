"""The cost model: compute, communication, memory, 1F1B schedule simulation, and `estimate(plan, cluster)`.

Formulas and every named factor: docs/cost-model.md.
"""
