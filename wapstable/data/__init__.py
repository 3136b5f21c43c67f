"""The data: samples (an image and its LaTeX tokens), the vocabulary, the three sources (`synthetic`, rendered by
the project; `crohme`, InkML; `wap_pkl`, WAP's pickles) and the batches of a split (`batches`)."""
