#!/usr/bin/env bash
# session 10, 1 x H200, call 2: host work of rank 0's TP <-> DP
# program with no peer (fake process group), 8 and 32 layers, plain and under cProfile
O=/tmp/o2; rm -rf $O; mkdir -p $O
nvidia-smi -L > $O/machine.txt; cat .devrun/tree.txt >> $O/machine.txt; lscpu | grep "Model name" >> $O/machine.txt
python3 -c "import torch,triton;print(torch.__version__, triton.__version__, torch.cuda.nccl.version())" >> $O/machine.txt
cd benchmarks/multi_gpu
timeout 120 python3 host_only.py --layers 8 --repeats 15 --profile $O/prof8.txt --json-out $O/ho8.json > $O/ho8.log 2>&1; echo "ho8 rc=$?" >> $O/steps.txt
timeout 150 python3 host_only.py --layers 32 --repeats 7 --profile $O/prof32.txt --json-out $O/ho32.json > $O/ho32.log 2>&1; echo "ho32 rc=$?" >> $O/steps.txt
cd ../..
echo skipped-unit >> $O/steps.txt
cp .devrun/s10single2.sh $O/
tar czf $OUT/single2.tgz -C $O .
cat $O/steps.txt; tail -3 $O/unit.log; grep -h "^plain\|^profiled" $O/ho8.log $O/ho32.log; tail -5 $O/ho32.log | cut -c1-300
