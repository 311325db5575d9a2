#!/usr/bin/env bash
O=/tmp/o; mkdir -p $O
timeout 100 python3 .devrun/race_debug.py > $O/debug_before.log 2>&1; echo "before rc=$?" >> $O/steps.txt
patch -p1 < .devrun/fix_side_wait.patch > $O/patch.log 2>&1
timeout 100 python3 .devrun/race_debug.py > $O/debug_after.log 2>&1; echo "after rc=$?" >> $O/steps.txt
tar czf $OUT/single6.tgz -C $O .
cat $O/steps.txt; tail -c 1500 $O/debug_before.log; echo; tail -c 800 $O/debug_after.log
