"""Plain Flower FedAvg on the joint-DP app's data and model, without DP (the benchmarks' baseline)."""
