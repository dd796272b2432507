"""pyscore: label scoring (SIS / MIS / setwise) and generation for decoder LMs, over a C++/CUDA extension."""
