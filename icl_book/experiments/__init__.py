"""The paper's experiments, the book's figures and the benchmarks.

One module per chapter that runs an experiment, exported from that chapter
(`nbs/NN_<module>.ipynb` exports the method `icl_book.<module>` and its
experiment `icl_book.experiments.<module>`). Library modules never import this
package; the CLI and `bench/` do.
"""
