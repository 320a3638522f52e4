"""Subject-level DP on Tiny Shakespeare (speaking characters as subjects, 16 silos):
the five methods of Marathe et al. at reduced scale, through the project's
ServerApp strategy and ClientApp on an in-process grid.

    python examples/subject_dp/shakespeare.py --data-dir ../shared/data/tinyshakespeare \\
        --alpha 1 --runs fedavg local-item-dp higradavg-exact local-group-dp user-ldp

Scale (2 CPU cores): the 134 characters with at least 1,000 characters of training
text; records of 40 characters with the next character at every position
(stride 40; 21.5 k records before the validation split); an embedding-8, LSTM-32 model
(:mod:`flwr_jdp.models.char_lstm`, 8 k parameters) instead of LEAF's 2-layer
LSTM-256 on 80-character windows. Same options and outputs as ``femnist.py``:
rows go to ``results/subject_dp/shakespeare.csv``, runs to
``results/subject_dp/runs/shakespeare_<run>_alpha<a>.json``.
"""

from __future__ import annotations

from femnist import main

if __name__ == "__main__":
    main("shakespeare", __doc__)
