source benchmarks/gpu_env.sh
C=$(cat GIT_COMMIT | cut -c1-7); D=$OUT/call2_$C; mkdir -p $D; cp $OUT/device.csv $OUT/versions.txt $D/
timeout 200 python3 -m benchmarks.kernels_mla --out $D/heads --tiles 16,64,4,2 16,64,4,3 32,32,8,3 32,64,8,3 64,32,8,3 64,32,8,4 32,32,8,4 --forms heads > $D/kernels_mla_heads.log 2>&1; tail -1 $D/kernels_mla_heads.log
timeout 100 python3 -m benchmarks.kernels_mla --out $D/keys --tiles 32,32,8,3 64,32,8,3 16,32,4,4 --forms keys > $D/kernels_mla_keys.log 2>&1; tail -1 $D/kernels_mla_keys.log
timeout 100 python3 -m benchmarks.kernels_dsa --out $D --decode-only --tiles 32,32,8,3 64,32,8,3 64,32,8,4 16,64,4,3 > $D/kernels_dsa.log 2>&1; tail -1 $D/kernels_dsa.log
timeout 170 python3 -m pytest -q -rfE -m gpu -p no:cacheprovider tests/kernels/test_mla_triton.py tests/kernels/test_dsa_triton.py tests/kernels/test_dsa_triton_tiles.py > $D/gpu_tests_mla_dsa.log 2>&1; tail -3 $D/gpu_tests_mla_dsa.log
