"""B: the update/reference grouped attention in head-major layouts: q, k, v transposed once per
layer so every score and value product is a plain batched matmul. The test models' scores only
(scale and soft-cap; no sliding window)."""
import jax.numpy as jnp

from rloo_jax.models import attention, transformer


def head_major(q_bshgd, k_bshd, v_bshd, prompt_mask_bp, mask_bmt, num_prompt, spec=None,
               positions_bs=None):
  del positions_bs
  if spec is not None and spec.window is not None:
    raise NotImplementedError('head_major_attention: no sliding window')
  spec = spec or attention._plain(q_bshgd)
  p = num_prompt
  b, _, h, g, d = q_bshgd.shape
  m, t = mask_bmt.shape[1:]
  f32 = jnp.float32
  q_p = jnp.transpose(q_bshgd[:, :p], (0, 2, 3, 1, 4))
  # Completion rows are token-major (row P + i*M + j: token i of completion j).
  q_c = jnp.transpose(q_bshgd[:, p:].reshape(b, t, m, h, g, d), (0, 3, 2, 4, 1, 5))
  kt_p = jnp.transpose(k_bshd[:, :p], (0, 2, 3, 1))
  kt_c = jnp.transpose(k_bshd[:, p:].reshape(b, t, m, h, d), (0, 3, 2, 4, 1))
  v_p = jnp.transpose(v_bshd[:, :p], (0, 2, 1, 3))
  v_c = jnp.transpose(v_bshd[:, p:].reshape(b, t, m, h, d), (0, 3, 2, 1, 4))
  s_pp = spec.logits(jnp.einsum('bhgsd,bhdt->bhgst', q_p, kt_p, preferred_element_type=f32))
  causal_pp = jnp.arange(p)[:, None] >= jnp.arange(p)[None, :]
  mask_pp = causal_pp[None, None, None] & prompt_mask_bp.astype(bool)[:, None, None, None, :]
  out_p = jnp.einsum('bhgst,bhtd->bhgsd',
                     attention._softmax_f32(s_pp, mask_pp).astype(v_bshd.dtype), v_p)
  scores = spec.logits(jnp.concatenate(
      [jnp.einsum('bhmgtd,bhdp->bhmgtp', q_c, kt_p, preferred_element_type=f32),
       jnp.einsum('bhmgtd,bhmds->bhmgts', q_c, kt_c, preferred_element_type=f32)], -1))
  mask_p = jnp.broadcast_to(prompt_mask_bp.astype(bool)[:, None, None, None, None, :],
                            (b, 1, m, 1, t, p))
  causal_ts = jnp.arange(t)[:, None] >= jnp.arange(t)[None, :]
  mask_c = causal_ts[None, None, None, None] & mask_bmt.astype(bool)[:, None, :, None, None, :]
  mask = jnp.concatenate([mask_p, jnp.broadcast_to(mask_c, (b, 1, m, 1, t, t))], axis=-1)
  probs = attention._softmax_f32(scores, mask).astype(v_bshd.dtype)
  out_c = (jnp.einsum('bhmgtp,bhpd->bhmgtd', probs[..., :p], v_p)
           + jnp.einsum('bhmgts,bhmsd->bhmgtd', probs[..., p:], v_c))
  out_c = jnp.transpose(out_c, (0, 4, 2, 1, 3, 5)).reshape(b, t * m, h, g, d)
  return jnp.concatenate([jnp.transpose(out_p, (0, 3, 1, 2, 4)), out_c], axis=1)


def apply():
  # transformer.py imports the kernel by name (Transformer.grouped calls it there): both bindings.
  attention._grouped_attention = head_major
  transformer._grouped_attention = head_major
