"""`quantize fit`: the per-layer precision assignment that fits a GPU, context and users.

One job per module: budget (the weight budget per GPU from the planner's memory model), units
(the knapsack's items: Linear layers, fused shards tied), sensitivity (per-unit cost measured
on the calibration data, cached), knapsack (the multiple-choice knapsack DP), assign (the
problem and its solution), recipe_writer (the assignment as a recipe with overrides), report
(summary, fit.json, Pareto plot). The pipeline run itself is the CLI's (quantize/cli/fit_cmd.py):
this package sits below quantize.pipeline.
"""
