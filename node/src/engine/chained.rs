//! Decoding one step ahead of the host on a GPU: where a whole model's fused step runs there and
//! the sampler's settings let the GPU pick (greedy, or a plain temperature draw), each step's
//! token is picked on the GPU and fed from there into the next step, which is queued before the
//! host reads the token. The GPU then goes from step to step without waiting for the host's
//! round trip (reading the id, checking stops, uploading the next token). The tokens are the
//! ones the host-driven loop picks: the same kernels, and the same uniform draws in the same order.
//! What it does not do: penalties or top-k / top-p / min-p cuts (they need the host), shards of
//! a pipeline (their next token comes from another node), or anything on a CPU.

use super::cache::ShardCache;
use super::sampler::Sampler;
use super::shard::Shard;
use super::Result;

#[cfg(feature = "cuda")]
type Chain = super::cuda_decode::DeviceChain;
#[cfg(not(feature = "cuda"))]
type Chain = std::convert::Infallible;

pub struct ChainedDecode<'a> {
    shard: &'a Shard,
    chain: Chain,
    temperature: f32,
    /// The step queued ahead: its input is the token the previous `next` returned.
    ahead: Option<u64>,
}

impl<'a> ChainedDecode<'a> {
    /// Chained decoding for one sequence of `shard`, when it is a whole model whose fused GPU
    /// step embeds its tokens, whose logits need no soft-cap, and `sampler` can pick on the GPU;
    /// otherwise `None` (the caller steps and samples on the host). `SHOAL_CHAINED=0` turns it off
    /// (a diagnostic, to compare).
    pub fn new(shard: &'a Shard, sampler: &Sampler) -> Result<Option<Self>> {
        let Some(temperature) = sampler.device_temperature() else { return Ok(None) };
        if std::env::var("SHOAL_CHAINED").is_ok_and(|v| v == "0") || !shard.is_first() || !shard.is_last() || shard.spec.final_logit_softcap.is_some() {
            return Ok(None);
        }
        #[cfg(feature = "cuda")]
        if let Some(fused) = shard.fused().filter(|f| f.enabled() && f.takes_tokens()) {
            let chain = fused.chain(shard.spec.vocab_size)?;
            return Ok(Some(ChainedDecode { shard, chain, temperature, ahead: None }));
        }
        #[cfg(not(feature = "cuda"))]
        let _ = temperature;
        Ok(None)
    }

    /// The token after `last`, the sequence's latest token (not yet fed to the model). With
    /// `more` (the caller will ask for the token after this one too) the step that feeds this
    /// call's token is queued before this call waits.
    pub fn next(&mut self, last: u32, more: bool, cache: &mut ShardCache, sampler: &mut Sampler) -> Result<u32> {
        #[cfg(feature = "cuda")]
        {
            let fused = self.shard.fused().ok_or_else(|| super::EngineError::Shard("the fused step is gone".into()))?;
            let k = match self.ahead.take() {
                Some(k) => k,
                None => {
                    self.shard.check_context(cache.position(), 1)?;
                    fused.queue_chained(&mut self.chain, Some(last), self.temperature, sampler.device_uniform(), cache)?
                }
            };
            if more {
                self.shard.check_context(cache.position(), 1)?;
                self.ahead = Some(fused.queue_chained(&mut self.chain, None, self.temperature, sampler.device_uniform(), cache)?);
            }
            self.chain.picked(k)
        }
        #[cfg(not(feature = "cuda"))]
        {
            let _ = (last, more, cache, sampler, self.shard, self.temperature, self.ahead);
            match self.chain {}
        }
    }

    /// Ends the sequence's decoding: waits for a step queued ahead and takes its position back
    /// out of `cache`, which then holds what the host-driven loop leaves (every token but the
    /// last one fed).
    pub fn finish(self, cache: &mut ShardCache) {
        if self.ahead.is_some() {
            cache.truncate(cache.position().saturating_sub(1));
        }
        // Dropping the chain waits for its queued steps.
    }
}
