//! Prints the top candidates at each greedy step for a prompt: a debugging aid for
//! comparing against other engines (which tokens are near-ties). Not used by tests.

use shoal::engine::shard::{ShardInput, ShardOutput};
use shoal::engine::{LoadOptions, LoadedModel};

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let (path, prompt, steps) = (&args[1], &args[2], args.get(3).map(|s| s.parse()).transpose()?.unwrap_or(8usize));
    let model = LoadedModel::load(path.as_ref(), &LoadOptions::default())?;
    let mut ids = model.text.encode_prompt(prompt)?;
    let mut cache = model.shard.new_cache();
    let mut input = ids.clone();
    for step in 0..steps {
        let ShardOutput::Logits(l) = model.shard.forward(ShardInput::Tokens(&input), &mut cache, false)? else { anyhow::bail!("no logits") };
        let l = l.squeeze(0)?.to_vec1::<f32>()?;
        let mut order: Vec<usize> = (0..l.len()).collect();
        order.sort_by(|a, b| l[*b].total_cmp(&l[*a]));
        let top: Vec<String> = order[..3].iter().map(|&i| format!("{i} {:?} {:.3}", model.text.decode(&[i as u32]).unwrap_or_default(), l[i])).collect();
        println!("step {step}: {}", top.join(" | "));
        ids.push(order[0] as u32);
        input = vec![order[0] as u32];
    }
    Ok(())
}
