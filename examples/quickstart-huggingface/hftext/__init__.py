"""A Flower / Hugging Face app: a tiny transformer classifying short synthetic reviews."""
