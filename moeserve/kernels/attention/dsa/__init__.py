"""DeepSeek Sparse Attention (DSA): the torch references (`reference`), the lightning indexer's
scores and top-k in Triton (`indexer_triton`) and absorbed MLA over the selection
(`sparse_triton`)."""
