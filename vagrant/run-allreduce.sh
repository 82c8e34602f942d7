#!/usr/bin/env bash
# All-reduce from every worker VM through the aggregator VMs' xaggd, then
# check the sums on w0 against numpy. Run from vagrant/ after `vagrant up`
# and `xaggd start` on each aggregator (see Vagrantfile).
set -euo pipefail
WORKERS=${WORKERS:-4}; AGGREGATORS=${AGGREGATORS:-1}; SUBNET=${XAGG_SUBNET:-192.168.77}
SIZE=${SIZE:-1000003}; JOB=${JOB:-7}; COOKIE=${COOKIE:-12345}
aggs=$(for i in $(seq 0 $((AGGREGATORS - 1))); do printf "%s.%d," "$SUBNET" $((101 + i)); done)
aggs=${aggs%,}
for i in $(seq 0 $((AGGREGATORS - 1))); do
  vagrant ssh "agg$i" -c "sudo /xagg/.venv/bin/python -c \"
from xagg.wire.control import ControlClient
aggs = [{'addr': a, 'weight': 1.0} for a in '$aggs'.split(',')]
print(ControlClient().register($JOB, cookie=$COOKIE, max_elements=$SIZE, n_workers=$WORKERS,
                                aggregators=aggs, agg_index=$i, bcast_ip='$SUBNET.255'))\"" </dev/null
done
for i in $(seq 0 $((WORKERS - 1))); do
  vagrant ssh "w$i" -c "cd /xagg && .venv/bin/python -m xagg.lab.traffic --job-id $JOB --cookie $COOKIE \
     --worker $i --workers $WORKERS --aggregators $aggs --sizes $SIZE --rounds 3 --out /tmp" </dev/null &
done
wait
echo "all workers finished; results in /tmp/w*_r*_s$SIZE.npy on each worker VM"
