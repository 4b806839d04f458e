//! `cudarc::nccl::safe`'s paths and signatures over [`crate::Comm`].
