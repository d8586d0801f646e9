"""Attention fwd+bwd microbenchmark (tiny config shapes): our einsum GQA attention vs
jax.nn.dot_product_attention. python benchmarks/profile_attention.py"""
import sys; sys.path.insert(0,'.')
import common, jax, jax.numpy as jnp
B,T,H,K,D=8,256,4,2,16
ks = jax.random.split(jax.random.key(0), 3)
q = jax.random.normal(ks[0], (B,T,H,D)); k = jax.random.normal(ks[1], (B,T,K,D)); v = jax.random.normal(ks[2], (B,T,K,D))
pos = jnp.broadcast_to(jnp.arange(T), (B,T))
def ours(q,k,v):
  qq = q.reshape(B,T,K,H//K,D)
  s = jnp.einsum("btkgd,bskd->bkgts", qq, k) * D**-0.5
  m = pos[:,None,:] <= pos[:,:,None]
  s = jnp.where(m[:,None,None], s, jnp.finfo(jnp.float32).min)
  p = jax.nn.softmax(s, -1)
  return jnp.einsum("bkgts,bskd->btkgd", p, v).reshape(B,T,H*D)
def xla(q,k,v):
  return jax.nn.dot_product_attention(q,k,v,is_causal=True).reshape(B,T,H*D)
f = {n: jax.jit(jax.grad(lambda q,k,v,fn=fn: (fn(q,k,v)**2).sum(), argnums=(0,1,2))) for n, fn in [("einsum",ours),("dot_product_attention",xla)]}
fw = {n+" fwd": jax.jit(fn) for n, fn in [("einsum",ours),("dot_product_attention",xla)]}
print(float(jnp.abs(ours(q,k,v)-xla(q,k,v)).max()))
t = common.time_interleaved({**{n: (lambda g=g: g(q,k,v)) for n,g in f.items()}, **{n: (lambda g=g: g(q,k,v)) for n,g in fw.items()}}, warmup=2, repeats=7)
print({k_: round(common.median(x)*1e3,2) for k_, x in t.items()})
